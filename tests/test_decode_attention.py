"""The engine's decode attention variants (server/generation/attention.py) and their pick.

On the CPU, in float32: every variant that runs here equals "sdpa" (and a float64 reference)
on GQA inputs with padded rows and strided cache views; pick_decode_attention times them and
skips a variant that raises or disagrees; ROLLSERVE_DECODE_ATTENTION forces the engine's
variant, and greedy tokens do not depend on it. The CUDA-only SDPA backends raise here; the
`gpu` tests check them and the warm-up's pick on a device.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from rollserve.server.experience.generation import SamplingParams, left_pad
from rollserve.server.generation import Engine, read_family
from rollserve.server.generation.attention import (
    DECODE_ATTENTION,
    DEFAULT_DECODE_ATTENTION,
    PICK_MARGIN,
    _fastest,
    additive_mask,
    decode_attention,
    decode_attention_matmul,
    decode_attention_variants,
    pick_decode_attention,
)
from rollserve.server.generation.runner import DECODE_ATTENTION_ENV

CPU_VARIANTS = ["sdpa", "matmul"]
CUDA_ONLY = ["sdpa_efficient", "sdpa_cudnn"]  # SDPA backends with no CPU kernel
PAD = 0
VOCAB = 96
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33], [40], [50, 51, 52, 53, 54, 55]]


def test_the_variant_table_is_what_the_tests_cover() -> None:
    assert DEFAULT_DECODE_ATTENTION == "sdpa"
    assert sorted(DECODE_ATTENTION) == sorted(CPU_VARIANTS + CUDA_ONLY)


def inputs(
    rows: int = 5,
    heads: int = 6,
    kv_heads: int = 2,
    dim: int = 16,
    width: int = 24,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (b, H, D); k, v (b, Hkv, w, D) as the engine's cache views: layer 1 of a (layers, R,
    Hkv, W, D) buffer wider in rows and columns than the step reads; an additive mask (b, w)
    of left pads and unwritten columns (-inf), every row with some real columns."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device).to(dtype)

    layout = (2, rows + 3, kv_heads, width + 40, dim)
    k, v = randn(*layout)[1, :rows, :, :width], randn(*layout)[1, :rows, :, :width]
    assert not k.is_contiguous()
    columns = torch.arange(width, device=device)
    repeat = -(-rows // 5)  # a pattern of 5 rows (width >= 24)
    starts = torch.tensor([0, 3, 7, 1, 12], device=device).repeat(repeat)[:rows]  # left pads
    ends = torch.tensor([20, 24, 9, 15, 13], device=device).repeat(repeat)[:rows]  # written
    allowed = (columns[None] >= starts[:, None]) & (columns[None] < ends[:, None])
    return randn(rows, heads, dim), k, v, additive_mask(allowed, dtype)


def reference(q, k, v, mask, scale) -> torch.Tensor:
    """Repeated K/V and an explicit softmax in float64."""
    b, heads, dim = q.shape
    groups = heads // k.shape[1]
    k64 = k.double().repeat_interleave(groups, dim=1)  # (b, H, w, D)
    v64 = v.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("bhd,bhwd->bhw", q.double(), k64) * scale + mask.double()[:, None]
    return torch.einsum("bhw,bhwd->bhd", scores.softmax(-1), v64)


@pytest.mark.parametrize("name", CPU_VARIANTS)
def test_every_cpu_variant_equals_sdpa_and_the_reference(name: str) -> None:
    q, k, v, mask = inputs()
    scale = 0.3
    out = DECODE_ATTENTION[name](q, k, v, mask, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, decode_attention(q, k, v, mask, scale), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask, scale), atol=1e-5,
                               rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("name", CPU_VARIANTS)
def test_masked_columns_do_not_count(name: str) -> None:
    """Whatever a masked column holds (stale K/V of an earlier request) changes nothing."""
    q, k, v, mask = inputs()
    before = DECODE_ATTENTION[name](q, k, v, mask, 0.25)
    k, v = k.clone(), v.clone()
    masked = torch.isinf(mask)[:, None, :, None].expand_as(k)
    k[masked], v[masked] = 100.0, -100.0
    torch.testing.assert_close(DECODE_ATTENTION[name](q, k, v, mask, 0.25), before)


@pytest.mark.parametrize("name", CUDA_ONLY)
def test_cuda_backends_raise_on_the_cpu(name: str) -> None:
    """No fallback to another backend: the variant is the kernel its name says, or an error
    (which pick_decode_attention records as a failure)."""
    with pytest.raises(RuntimeError):
        DECODE_ATTENTION[name](*inputs(), 0.25)


def test_the_sdpa_kernel_context_ends_with_the_call() -> None:
    """sdpa_kernel's flags are process-wide: after a variant (even a failing one) SDPA may
    again pick any backend (here the CPU's own)."""
    q, k, v, mask = inputs()
    with pytest.raises(RuntimeError):
        DECODE_ATTENTION["sdpa_efficient"](q, k, v, mask, 0.25)
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    decode_attention(q, k, v, mask, 0.25)


def test_pick_times_every_variant_on_the_cpu() -> None:
    q, k, v, mask = inputs()
    name, timings = pick_decode_attention(q, k, v, mask, 0.25, repeats=3)
    assert name in CPU_VARIANTS
    assert list(timings) == list(DECODE_ATTENTION)
    for variant in CPU_VARIANTS:
        assert timings[variant] > 0
    for variant in CUDA_ONLY:
        assert math.isnan(timings[variant])


def test_pick_skips_a_variant_that_raises_or_disagrees(caplog) -> None:
    """A variant that raises, or that is fast and wrong, is never the choice."""
    q, k, v, mask = inputs()

    def broken(q, k, v, mask, scale):
        raise RuntimeError("no kernel for these inputs")

    def wrong(q, k, v, mask, scale):  # faster than anything: and wrong
        return q

    def half_scale(q, k, v, mask, scale):  # close, not the same math
        return decode_attention_matmul(q, k, v, mask, scale / 2)

    variants = {"sdpa": decode_attention, "broken": broken, "wrong": wrong,
                "half_scale": half_scale, "matmul": decode_attention_matmul}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="rollserve.generation"):
        name, timings = pick_decode_attention(q, k, v, mask, 0.25, repeats=3, variants=variants)
    assert name in ("sdpa", "matmul")
    assert list(timings) == list(variants)
    for bad in ("broken", "wrong", "half_scale"):
        assert math.isnan(timings[bad])
    assert timings["sdpa"] > 0 and timings["matmul"] > 0
    text = caplog.text
    assert "broken failed (RuntimeError: no kernel" in text
    assert "wrong disagrees with sdpa" in text and "half_scale disagrees" in text


def test_a_near_tie_keeps_the_default() -> None:
    nan = math.nan
    assert _fastest({"sdpa": 1.0, "matmul": 1.0 - PICK_MARGIN / 2}) == "sdpa"
    assert _fastest({"sdpa": 1.0, "matmul": 0.9, "sdpa_efficient": 0.8}) == "sdpa_efficient"
    assert _fastest({"sdpa": nan, "matmul": 2.0}) == "matmul"
    assert _fastest({"sdpa": nan, "matmul": nan}) == "sdpa"


# ---- the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2():
    """A tiny GQA model (4 query heads per 2 KV heads) in float32."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def greedy(engine: Engine, new_tokens: int = 20):
    ids, mask = left_pad(PROMPTS, PAD, torch.device("cpu"))
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    return engine.generate(ids, mask, params, pad_token_id=PAD, generator=torch.Generator())


def test_the_engine_runs_sdpa_unless_told(qwen2, monkeypatch) -> None:
    monkeypatch.delenv(DECODE_ATTENTION_ENV, raising=False)
    engine = Engine(qwen2, read_family(qwen2))
    assert engine.decode_attention == "sdpa" == engine.forward.decode_attention_variant
    assert engine.decode_attention_ms == {}
    # No timing off CUDA: the warm-up keeps the default.
    engine.warm_up(SamplingParams(max_new_tokens=4, temperature=0.0), 4, 7, pad_token_id=PAD)
    assert engine.decode_attention == "sdpa" and engine.decode_attention_ms == {}


def test_the_environment_forces_the_variant(qwen2, monkeypatch) -> None:
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "matmul")
    engine = Engine(qwen2, read_family(qwen2))
    assert engine.decode_attention == "matmul"
    engine.warm_up(SamplingParams(max_new_tokens=4, temperature=0.0), 4, 7, pad_token_id=PAD)
    assert engine.decode_attention == "matmul" and engine.decode_attention_ms == {}
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "flashy")
    with pytest.raises(ValueError, match="unknown decode attention variant 'flashy'"):
        Engine(qwen2, read_family(qwen2))
    with pytest.raises(ValueError, match="known: sdpa, "):
        engine.forward.decode_attention_variant = "flashy"
    assert engine.decode_attention == "matmul"  # a refused name changes nothing


def test_greedy_tokens_are_the_same_with_every_cpu_variant(qwen2, monkeypatch) -> None:
    results = {}
    for name in CPU_VARIANTS:
        monkeypatch.setenv(DECODE_ATTENTION_ENV, name)
        engine = Engine(qwen2, read_family(qwen2))
        assert engine.decode_attention == name
        results[name] = greedy(engine)
    first, *others = results.values()
    assert first.response_mask.all()  # no EOS: every row generated every token
    for other in others:
        assert torch.equal(other.response, first.response)
        torch.testing.assert_close(other.log_probs, first.log_probs, atol=1e-5, rtol=0)


def test_the_engines_pick_times_the_workspace_views(qwen2, monkeypatch, caplog) -> None:
    """What warm_up runs on CUDA, called here on the CPU: the variant chosen, its timings
    kept and logged, the cache views zeros again."""
    monkeypatch.delenv(DECODE_ATTENTION_ENV, raising=False)
    engine = Engine(qwen2, read_family(qwen2))
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    with torch.inference_mode():
        ws = engine.workspace(8, 7, params, PAD)
        with caplog.at_level(logging.INFO, logger="rollserve.generation"):
            stale = engine._pick_decode_attention(ws, 8, 128)
    assert not stale  # no graph was captured with the old variant
    assert engine.decode_attention in CPU_VARIANTS
    assert list(engine.decode_attention_ms) == list(DECODE_ATTENTION)
    assert all(engine.decode_attention_ms[n] > 0 for n in CPU_VARIANTS)
    assert not ws.k.any() and not ws.v.any()
    assert f"-> {engine.decode_attention}" in caplog.text
    assert "decode attention (8 rows x 128 columns): sdpa " in caplog.text
    # Settled: later warm-ups keep it (graphs captured with it stay consistent).
    assert engine._attention_settled
    first = greedy(engine, 6)
    monkeypatch.setenv(DECODE_ATTENTION_ENV, "sdpa")
    assert torch.equal(first.response, greedy(Engine(qwen2, read_family(qwen2)), 6).response)


# ---- CUDA ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_pick_on_the_issue_shape() -> None:
    """Qwen2-0.5B's decode shape (14 heads per 2 KV heads, head_dim 64, bfloat16), 512 rows
    at 384 columns of strided cache views: every variant that runs agrees with sdpa (else it
    is NaN), sdpa runs, the choice is one of those timed."""
    q, k, v, mask = inputs(512, 14, 2, 64, 384, torch.bfloat16, "cuda")
    mask = torch.zeros_like(mask)
    with torch.inference_mode():
        name, timings = pick_decode_attention(q, k, v, mask, 0.125)
    print(timings, "->", name)
    assert list(timings) == list(decode_attention_variants(torch.device("cuda")))  # + flex
    assert timings["sdpa"] > 0 and timings[name] > 0
    assert timings["matmul"] > 0  # plain batched matmuls run on any device


@pytest.mark.gpu
@pytest.mark.parametrize("name", CPU_VARIANTS + CUDA_ONLY)
def test_cuda_variants_match_in_bfloat16_with_padding(name: str) -> None:
    q, k, v, mask = inputs(5, 14, 2, 64, 24 * 16, torch.bfloat16, "cuda")
    try:
        out = DECODE_ATTENTION[name](q, k, v, mask, 0.125)
    except RuntimeError as error:  # a backend this torch/device lacks: the pick skips it
        pytest.skip(f"{name}: {error}")
    torch.testing.assert_close(out.float(), reference(q, k, v, mask, 0.125).float(), atol=3e-2,
                               rtol=3e-2)  # fmt: skip


@pytest.mark.gpu
def test_cuda_warm_up_picks_before_capturing(monkeypatch) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    monkeypatch.delenv(DECODE_ATTENTION_ENV, raising=False)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to("cuda").eval()
    # Uncompiled: torch.compile's minutes are not what this checks.
    engine = Engine(model, read_family(model), kv_cache_tokens=1 << 16, compiled=False)
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    engine.warm_up(params, 8, 7, pad_token_id=PAD)
    # Not compiled: the compiled variants (flex) are not timed either.
    assert list(engine.decode_attention_ms) == list(DECODE_ATTENTION)
    assert engine.decode_attention_ms[engine.decode_attention] > 0
    (ws,) = engine._workspaces.values()
    assert ws.graphs  # captured with the chosen variant
    chosen, timings = engine.decode_attention, dict(engine.decode_attention_ms)
    engine.warm_up(params, 8, 7, pad_token_id=PAD)  # a second warm-up keeps it
    assert engine.decode_attention == chosen and engine.decode_attention_ms == timings
    ids, mask = left_pad(PROMPTS, PAD, torch.device("cuda"))
    out = engine.generate(ids, mask, params, pad_token_id=PAD,
                          generator=torch.Generator(device="cuda"))  # fmt: skip
    assert out.response_mask.all()
