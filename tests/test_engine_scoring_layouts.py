"""The engine's scoring forward against HF's over random row layouts (hypothesis), on the CPU.

test_engine_scoring.py pins a few layouts; here any layout a request can make: groups of 1 to 4
samples (a GRPO group: the engine runs its prompt once), prompts of 1 to 6 tokens left-padded
to the widest, responses of 1 to the widest length right-padded, the same prompt in groups that
are not neighbours, and forward batches and lm_head chunks that cut groups anywhere. The
log-probs and entropy of every compared action column equal HF's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollserve.server.experience.scoring import action_log_probs
from test_engine_scoring import VOCAB, _built, compared

GROUPS = st.lists(
    st.tuples(
        st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6),  # the prompt
        st.lists(st.integers(1, 7), min_size=1, max_size=4),  # each sample's response length
    ),
    min_size=1,
    max_size=4,
)


@pytest.fixture(scope="module", params=["qwen2", "mistral"])
def model(request, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    # qwen2: biases on q/k/v; mistral: a sliding window shorter than the rows.
    return _built("causal_lm", request.param, tmp_path_factory.mktemp(request.param))


def layout(
    groups: list[tuple[list[int], list[int]]], repeat_first: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sequences (B, P + A), mask, A: each group's prompt once per sample, left-padded; random
    responses right-padded; with `repeat_first`, the first group's prompt again at the end
    (the same prompt in groups that are not neighbours)."""
    if repeat_first:
        groups = [*groups, (groups[0][0], [1])]
    g = torch.Generator().manual_seed(seed)
    width = max(len(prompt) for prompt, _ in groups)
    actions = max(max(lengths) for _, lengths in groups)
    rows = [(prompt, length) for prompt, lengths in groups for length in lengths]
    # Pads are random ids too: under a mask they must not matter.
    sequences = torch.randint(0, VOCAB, (len(rows), width + actions), generator=g)
    mask = torch.zeros_like(sequences)
    for row, (prompt, length) in enumerate(rows):
        sequences[row, width - len(prompt) : width] = torch.tensor(prompt)
        sequences[row, width : width + length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask[row, width - len(prompt) : width + length] = 1
    return sequences, mask, actions


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=GROUPS,
    repeat_first=st.booleans(),
    forward_batch_size=st.integers(1, 6),
    positions_per_chunk=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_any_layout_scores_as_hf(
    model: torch.nn.Module,
    groups: list[tuple[list[int], list[int]]],
    repeat_first: bool,
    forward_batch_size: int,
    positions_per_chunk: int,
    seed: int,
) -> None:
    sequences, mask, actions = layout(groups, repeat_first, seed)
    kw = dict(
        forward_batch_size=forward_batch_size,
        with_entropy=True,
        positions_per_chunk=positions_per_chunk,
    )
    ours = action_log_probs(model, sequences, mask, actions, path="rollserve", **kw)
    theirs = action_log_probs(model, sequences, mask, actions, path="hf", **kw)
    where = compared(model, mask, actions)
    for mine, hf in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine[where], hf[where], atol=1e-5, rtol=1e-5)


def test_the_layouts_hold_shared_prompts(tmp_path: Path) -> None:
    """The strategy makes what the engine shares: a group's rows with one prompt."""
    sequences, mask, actions = layout([([5, 6, 7], [2, 3, 1]), ([9], [4])], False, 0)
    width = sequences.shape[1] - actions
    assert torch.equal(sequences[0, :width], sequences[1, :width])
    assert mask[:3, :width].eq(torch.tensor([1, 1, 1])).all()
    assert mask[3, : width - 1].eq(0).all() and mask[3, width - 1] == 1
