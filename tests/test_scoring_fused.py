"""The compiled block log-prob (CUDA's path, forced onto the CPU here) equals the eager one.

Compiling on the CPU takes seconds per graph: the cases share one block shape per dtype, so the
whole file compiles about a dozen small graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rollserve.server.experience import scoring
from rollserve.server.experience.scoring import action_log_probs
from rollserve.server.experience.vocab_chunks import VOCAB_CHUNKS_ENV
from test_scoring import layout

VOCAB = 300
POSITIONS = 37


def random_block(dtype: torch.dtype, positions: int = POSITIONS, seed: int = 0):
    """Logits (positions, VOCAB) in `dtype` with a few -inf entries (one of them a label), and
    labels (positions,)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(positions, VOCAB, generator=generator) * 4
    logits[:, 7] = float("-inf")  # a token no position can emit
    labels = torch.randint(0, VOCAB, (positions,), generator=generator)
    labels[0] = 7
    return logits.to(dtype), labels


@pytest.fixture
def fused_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU joins the devices whose blocks run compiled (CUDA's by default)."""
    monkeypatch.setattr(scoring, "FUSED_BLOCK_DEVICES", frozenset({"cuda", "cpu"}))


def compiled_block(logits, labels, temperature: float | None, with_entropy: bool):
    """Through the module's one compiled function, as _chunked_log_probs calls it on CUDA."""
    fused = scoring._fused_scorer(logits.device, temperature, with_entropy)
    assert fused is not None
    return fused(logits, labels)


def assert_no_eager_fallback() -> None:
    """maybe_compiled runs eagerly after a compiler failure (a graph break, with fullgraph):
    the compiled function must still be there."""
    assert scoring._fused_block().compiled is not None


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [None, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.usefixtures("fused_on_cpu")
def test_compiled_block_equals_the_eager_block(
    dtype: torch.dtype, temperature: float | None, with_entropy: bool
) -> None:
    logits, labels = random_block(dtype)
    untouched = logits.clone()
    lp, ent = compiled_block(logits, labels, temperature, with_entropy)
    assert_no_eager_fallback()
    ref_lp, ref_ent = scoring._block_log_probs(
        logits.float().clone(), labels, temperature, with_entropy
    )
    assert lp.dtype == torch.float32 and lp.shape == (POSITIONS,)
    assert lp[0] == float("-inf")  # the -inf label
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    if with_entropy:
        # Every row holds a -inf (column 7): its probability 0 adds nothing, never nan.
        assert bool(torch.isfinite(ent).all()) and bool(torch.isfinite(ref_ent).all())
        finite = logits.float().clone()[:, torch.arange(VOCAB) != 7]
        if temperature is not None:
            finite = finite / temperature
        want = torch.distributions.Categorical(logits=finite).entropy()
        torch.testing.assert_close(ref_ent, want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=1e-5)
    else:
        assert ent is None and ref_ent is None
    # Float32 logits may be the model's own: the fused path leaves them as they were.
    assert torch.equal(logits, untouched)


@pytest.mark.usefixtures("fused_on_cpu")
def test_finite_entropy_and_other_shapes_without_a_recompile_per_temperature() -> None:
    """Blocks of 5 and 1 positions (a plan's smaller last block), three temperatures each."""
    torch._dynamo.reset()  # this test's graphs only, whatever ran before
    torch._dynamo.utils.counters.clear()
    for positions in (5, 1):
        for temperature in (1.9, 2.5, 0.4):
            logits, labels = random_block(torch.float32, positions, seed=positions)
            logits[:, 7] = 0.0  # finite: the entropy is a number
            lp, ent = compiled_block(logits, labels, temperature, True)
            ref_lp, ref_ent = scoring._block_log_probs(logits.clone(), labels, temperature, True)
            torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
            torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=1e-5)
            assert bool(ent.isfinite().all())
    assert_no_eager_fallback()
    # One graph per shape (a size of 1 is specialised), none per temperature value.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_action_log_probs_through_the_fused_path_equal_the_eager_path(
    tiny_actor_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 model, as on CUDA (float32 blocks are the block tests' case); the position
    blocks (tests/test_vocab_chunks.py has the vocabulary chunks, CUDA's default)."""
    monkeypatch.setenv(VOCAB_CHUNKS_ENV, "0")
    assert scoring._fused_scorer(torch.device("cpu"), None, False) is None  # eager by default
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_actor_dir, dtype=torch.bfloat16).eval()
    ids, mask, actions = layout()
    # 7 positions a block: a smaller last block of every forward batch.
    kwargs = dict(forward_batch_size=2, temperature=0.6, with_entropy=True, positions_per_chunk=7)
    eager_lp, eager_ent = action_log_probs(model, ids, mask, actions, **kwargs)
    monkeypatch.setattr(scoring, "FUSED_BLOCK_DEVICES", frozenset({"cuda", "cpu"}))
    compiled, block_sizes = scoring._fused_block(), []

    def spied(logits, *rest):  # the real compiled function, its blocks counted
        block_sizes.append(logits.shape[0])
        return compiled(logits, *rest)

    monkeypatch.setattr(scoring, "_fused_block", lambda: spied)
    lp, ent = action_log_probs(model, ids, mask, actions, **kwargs)
    assert compiled.compiled is not None  # no eager fallback
    assert 7 in block_sizes and min(block_sizes) < 7  # every block, the smaller last ones too
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, eager_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, eager_ent, atol=2e-5, rtol=1e-5)
