"""ROLLSERVE_PREFILL_ATTENTION (server/generation/attention.py): prefill and scoring attention on
CUDA through SDPA without its cuDNN backend by default ("efficient": cuDNN builds a plan per new
shape, +51-56 ms each on an H200), SDPA's own pick with "sdpa"; a name it does not know is a
ValueError when the engine's forward is built; off CUDA the backends are ignored (the efficient
kernel has no CPU version)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from rollserve.server.generation.attention import (
    MASK_BUILD_BYTES,
    PREFILL_ATTENTION_ENV,
    PrefillMasks,
    additive_mask,
    prefill_attention,
    prefill_backend,
    prefill_backends,
    prefill_mask,
    query_blocks,
)
from torch.nn.attention import SDPBackend

WITHOUT_CUDNN = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PREFILL_ATTENTION_ENV, raising=False)
    assert prefill_backend() == WITHOUT_CUDNN  # the default: every backend but cuDNN's
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "sdpa")
    assert prefill_backend() is None
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "efficient")
    assert prefill_backend() == WITHOUT_CUDNN
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "cudnn")
    with pytest.raises(ValueError, match=PREFILL_ATTENTION_ENV):
        prefill_backend()


def _inputs(device: str, dtype: torch.dtype):
    """GQA (4 query heads over 2 KV heads), left-padded rows, an additive causal mask."""
    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, s, d = 3, 4, 2, 9, 16
    q = torch.randn(b, heads, s, d, generator=g).to(device, dtype)
    k, v = (torch.randn(b, kv_heads, s, d, generator=g).to(device, dtype) for _ in range(2))
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, :3] = valid[2, :5] = False
    mask = additive_mask(prefill_mask(valid.to(device), None), dtype)
    return q, k, v, mask


def test_off_cuda_the_backend_is_ignored() -> None:
    q, k, v, mask = _inputs("cpu", torch.float32)
    with prefill_backends((SDPBackend.EFFICIENT_ATTENTION,), q.device):
        held = prefill_attention(q, k, v, mask, 0.25)
    assert torch.equal(held, prefill_attention(q, k, v, mask, 0.25))


def test_an_unknown_name_fails_the_engine_build(
    monkeypatch: pytest.MonkeyPatch, tiny_actor_dir
) -> None:
    from rollserve.server.generation import scoring_forward
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_actor_dir, dtype=torch.float32).eval()
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "fastest")
    with pytest.raises(ValueError, match="expected one of"):
        scoring_forward(model, "rollserve")
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "efficient")  # a CPU forward takes it, ignores it
    assert scoring_forward(model, "rollserve").prefill_backend == WITHOUT_CUDNN


@pytest.mark.gpu
def test_on_cuda_the_efficient_backend_equals_sdpas_pick() -> None:
    q, k, v, mask = _inputs("cuda", torch.bfloat16)
    picked = prefill_attention(q, k, v, mask, 0.25)
    for held_to in ((SDPBackend.EFFICIENT_ATTENTION,), WITHOUT_CUDNN):
        with prefill_backends(held_to, q.device):
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            held = prefill_attention(q, k, v, mask, 0.25)
        torch.testing.assert_close(held, picked, atol=2e-2, rtol=2e-2)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process's flags are back


def test_the_forward_hands_its_backend_to_every_prefill_and_scoring_attention(
    monkeypatch: pytest.MonkeyPatch, tiny_actor_dir
) -> None:
    # Both full-sequence paths: a prefill of distinct prompts and scoring's shared prompts.
    from rollserve.server.experience.scoring import action_log_probs
    from rollserve.server.generation import causal_rows
    from rollserve.server.generation import model as generation_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_actor_dir, dtype=torch.float32).eval()
    monkeypatch.setenv(causal_rows.CAUSAL_MIN_COLUMNS_ENV, str(1 << 30))  # the masked route
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "sdpa")  # not the default: it must come through
    seen: list[object] = []  # per attention call: the backends of the context it ran in
    active: list[object] = []

    @contextlib.contextmanager
    def backends_spy(backend, device):
        active.append(backend)
        try:
            with prefill_backends(backend, device):
                yield
        finally:
            active.pop()

    def attention_spy(*args):
        seen.append(active[-1] if active else "outside any")
        return prefill_attention(*args)

    monkeypatch.setattr(generation_model, "prefill_backends", backends_spy)
    monkeypatch.setattr(generation_model, "prefill_attention", attention_spy)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12, 13]])  # one prompt, 2 samples
    action_log_probs(model, ids, torch.ones_like(ids), 3, forward_batch_size=2, path="rollserve")
    layers = model.config.num_hidden_layers
    assert seen == [None] * 2 * layers  # the prompt once, the tails
    seen.clear()
    monkeypatch.delenv(PREFILL_ATTENTION_ENV)  # a new forward (another model) reads the default
    other = AutoModelForCausalLM.from_pretrained(tiny_actor_dir, dtype=torch.float32).eval()
    action_log_probs(other, ids, torch.ones_like(ids), 3, forward_batch_size=2, path="rollserve")
    assert seen == [WITHOUT_CUDNN] * 2 * layers
    # Long rows attend causally (causal_rows.py): one attention a layer, in the same context.
    seen.clear()
    monkeypatch.setenv(causal_rows.CAUSAL_MIN_COLUMNS_ENV, "0")
    monkeypatch.setattr(causal_rows, "prefill_attention", attention_spy)
    action_log_probs(other, ids, torch.ones_like(ids), 3, forward_batch_size=2, path="rollserve")
    assert seen == [WITHOUT_CUDNN] * layers


@pytest.mark.parametrize("rows, first, keys", [(4, 0, 50), (3, 20, 50), (1, 0, 7), (64, 128, 384)])
def test_query_blocks_cover_the_queries_in_order_within_the_bound(
    rows: int, first: int, keys: int
) -> None:
    per_query = rows * keys * (2 + MASK_BUILD_BYTES)  # bfloat16
    for budget in (1, per_query, 3 * per_query + 1, 10**12):
        blocks = query_blocks(rows, first, keys, torch.bfloat16, budget)
        assert [a for a, _ in blocks] == [first] + [b for _, b in blocks[:-1]]
        assert blocks[-1][1] == keys and all(a < b for a, b in blocks)
        sizes = [b - a for a, b in blocks]
        assert max(sizes) - min(sizes) <= 1  # near-equal
        assert max(sizes) == 1 or max(sizes) * per_query <= budget
        if budget >= (keys - first) * per_query:
            assert blocks == ((first, keys),)  # the whole mask fits: one block
        elif budget > per_query:  # no more blocks than the bound asks
            assert len(blocks) == -(-(keys - first) // (budget // per_query))
    # The default bound: the H200's scoring batch (64 x 384, bfloat16) is one block; 16 rows
    # of 8,192 tokens are not.
    assert len(query_blocks(64, 128, 384, torch.bfloat16)) == 1
    assert len(query_blocks(16, 0, 8192, torch.bfloat16)) > 1


@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("first_query", [0, 4])
def test_the_prefill_mask_is_what_its_rule_says(window: int | None, first_query: int) -> None:
    # Element by element: a query sees the real keys at or before it (within the window);
    # a query that sees none (a left pad; under a window, a pad after the window passed the
    # real tokens) sees only itself. Rows: left pads, right pads, both, none, all pads.
    valid = torch.tensor(
        [[0, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0, 0],
         [1, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool,
    )  # fmt: skip
    rows, s = valid.shape
    expected = torch.zeros(rows, 1, s - first_query, s, dtype=torch.bool)
    for b in range(rows):
        for i in range(first_query, s):
            seen = [j for j in range(i + 1) if valid[b, j] and (window is None or j > i - window)]
            for j in seen or [i]:
                expected[b, 0, i - first_query, j] = True
    mask = prefill_mask(valid, window, first_query)
    assert torch.equal(mask, expected)
    additive = additive_mask(mask, torch.float32)
    assert torch.equal(additive == 0, expected) and bool((additive[~expected] == -math.inf).all())


def test_the_masks_a_forward_keeps_at_once_share_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollserve.server.generation import attention

    valid = torch.ones(4, 50, dtype=torch.bool)
    valid[1, :9] = False
    whole = 4 * 50 * 50 * (4 + MASK_BUILD_BYTES)  # float32
    monkeypatch.setattr(attention, "MASK_BYTES", 2 * whole)
    one = PrefillMasks(valid, [None], torch.float32)
    assert one.blocks == ((0, 50),)  # one window: its whole mask fits
    assert torch.equal(
        one.block(None, 0, 50), additive_mask(prefill_mask(valid, None), torch.float32)
    )
    two = PrefillMasks(valid, [None, 6], torch.float32)
    assert two.blocks == ((0, 50),)  # two windows' whole masks: 2 x whole, within the bound
    shared = PrefillMasks(valid, [None, 6], torch.float32, first_query=10, parts=2)
    assert len(shared.blocks) > 1  # a quarter of the bound each: blocks of queries
    start, end = shared.blocks[1]
    block = shared.block(6, start, end)  # made on demand: the rows' block of the window's mask
    expected = additive_mask(prefill_mask(valid, 6, start), torch.float32)[
        :, :, : end - start, :end
    ]
    assert torch.equal(block, expected)


@pytest.mark.gpu
def test_on_cuda_attention_in_blocks_of_queries_equals_one_mask(
    tiny_actor_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bounded mask's blocks on the device's kernels (SDPA without cuDNN, bfloat16): slices
    # of the repeated K/V as keys, each block written into one output.
    from rollserve.server.experience.scoring import position_ids_from_mask
    from rollserve.server.generation import attention, causal_rows, scoring_forward
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv(causal_rows.CAUSAL_MIN_COLUMNS_ENV, str(1 << 30))  # the masked route
    model = AutoModelForCausalLM.from_pretrained(tiny_actor_dir, dtype=torch.bfloat16)
    forward = scoring_forward(model.eval().to("cuda"), "rollserve")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (6, 40), generator=g)
    ids[3:, :20] = ids[0, :20]  # rows 3-5 share row 0's prompt (the first 20 columns)
    mask = torch.ones_like(ids)
    mask[1, :7] = mask[2, :12] = mask[4, 35:] = 0  # left pads, one row's right pads
    ids, mask = ids.cuda(), mask.cuda()
    positions = position_ids_from_mask(mask)
    with torch.inference_mode():
        whole = [forward.hidden_states(ids, mask, positions, width) for width in (0, 20)]
        monkeypatch.setattr(attention, "MASK_BYTES", 6 * 40 * (2 + attention.MASK_BUILD_BYTES) * 3)
        blocked = [forward.hidden_states(ids, mask, positions, width) for width in (0, 20)]
    real = mask.bool()
    for one, blocks in zip(whole, blocked, strict=True):
        torch.testing.assert_close(blocks[real].float(), one[real].float(), atol=2e-2, rtol=2e-2)
