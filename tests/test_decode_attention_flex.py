"""The "flex" decode attention variant (server/generation/attention.py: a compiled
flex_attention), proved on the CPU, where Inductor compiles flex_attention to C++.

It equals "sdpa" (decode_attention) within the pick's tolerance on strided cache views with
padded rows, for query groups of 1, 2 and 7 heads per KV head and widths that are and are not
multiples of 128, in float32 and bfloat16; a -inf column gets probability 0; it compiles
whole (fullgraph) once per batch size: a new width (or cache layout) reuses the code, a new
batch size compiles once more (as the engine warms up: once per batch bucket). It is never
timed on the CPU (pick_decode_attention there times DECODE_ATTENTION only); the engine runs
it when ROLLSERVE_DECODE_ATTENTION=flex forces it. The `gpu` test checks it against sdpa on
CUDA in bfloat16, timed by the pick and captured in a CUDA graph.

Each distinct (batch, heads, dtype) compiles for seconds on a 2-core CPU: the tests share few
shapes (ROWS rows, widths of one batch size reuse one compile).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from rollserve.server.experience.generation import SamplingParams, left_pad
from rollserve.server.generation import Engine, attention, read_family
from rollserve.server.generation.attention import (
    COMPILED_DECODE_ATTENTION,
    DECODE_ATTENTION,
    _tolerance,
    additive_mask,
    decode_attention,
    decode_attention_flex,
    decode_attention_variant,
    decode_attention_variants,
    pick_decode_attention,
)
from rollserve.server.generation.compiling import COMPILE_ENV
from rollserve.server.generation.runner import DECODE_ATTENTION_ENV

ROWS = 5
# (query heads, KV heads, head dim): groups of 7 (Qwen2-0.5B's 14 / 2, head_dim 64), 2 and 1,
# head dims the CPU's compiled flex kernel serves (attention.CPU_FLEX_MIN_HEAD_DIM).
GROUPS = {7: (14, 2, 64), 2: (4, 2, 32), 1: (2, 2, 32)}
WIDTHS = (200, 256)  # not a multiple of 128, and one
PAD = 0
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33], [40], [50, 51, 52, 53, 54, 55]]


def inputs(
    rows: int = ROWS,
    group: int = 7,
    width: int = 200,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    layer: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (b, H, D); k, v (b, Hkv, w, D) as the engine's cache views: `layer` of a (layers, R,
    Hkv, W, D) buffer wider in rows and columns than the step reads (so never contiguous); an
    additive mask (b, w): left pads and unwritten columns -inf, every row with real columns.
    Made outside inference mode, as every test here does (an inference tensor is another
    dispatch key set to dynamo's guards: a recompile)."""
    heads, kv_heads, dim = GROUPS[group]
    g = torch.Generator(device=device).manual_seed(group * 1000 + width)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device).to(dtype)

    layout = (2, rows + 3, kv_heads, width + 40, dim)
    k, v = randn(*layout)[layer, :rows, :, :width], randn(*layout)[layer, :rows, :, :width]
    assert not k.is_contiguous() and not v.is_contiguous()
    columns = torch.arange(width, device=device)
    pattern = len(PROMPTS)
    starts = torch.tensor([0, 3, 7, 1, 12], device=device).repeat(-(-rows // pattern))[:rows]
    ends = torch.tensor([width, width - 3, width // 2, width - 17, 40], device=device)
    ends = ends.repeat(-(-rows // pattern))[:rows]
    allowed = (columns[None] >= starts[:, None]) & (columns[None] < ends[:, None])
    return randn(rows, heads, dim), k, v, additive_mask(allowed, dtype)


def assert_agrees(out: torch.Tensor, reference: torch.Tensor) -> None:
    """Within the tolerance pick_decode_attention holds every variant to."""
    assert out.shape == reference.shape and out.dtype == reference.dtype
    tol = _tolerance(reference.dtype)
    torch.testing.assert_close(out.float(), reference.float(), atol=tol, rtol=tol)


def compiled_graphs() -> int:
    """How many compiled versions dynamo holds of flex's function (one per guard set)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(attention._flex_grouped.__code__))


# ---- where it is registered -----------------------------------------------------------------


def test_flex_is_timed_only_where_the_engine_compiles(monkeypatch) -> None:
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert "flex" not in DECODE_ATTENTION and set(COMPILED_DECODE_ATTENTION) == {"flex"}
    assert decode_attention_variants(torch.device("cpu")) == DECODE_ATTENTION
    on_cuda = decode_attention_variants(torch.device("cuda"))  # a device name: no GPU needed
    assert list(on_cuda) == [*DECODE_ATTENTION, "flex"]
    assert on_cuda["flex"] is decode_attention_flex
    monkeypatch.setenv(COMPILE_ENV, "0")  # the engine runs eagerly: nothing compiled to time
    assert decode_attention_variants(torch.device("cuda")) == DECODE_ATTENTION
    assert decode_attention_variant("flex") is decode_attention_flex  # forced: any device


def test_the_pick_on_the_cpu_never_runs_flex(monkeypatch) -> None:
    calls = []

    def spy(*args):
        calls.append(args)
        raise AssertionError("flex timed on the CPU")

    monkeypatch.setitem(COMPILED_DECODE_ATTENTION, "flex", spy)
    q, k, v, mask = inputs(group=2)
    name, timings = pick_decode_attention(q, k, v, mask, 0.25, repeats=3)
    assert list(timings) == list(DECODE_ATTENTION) and name in ("sdpa", "matmul")
    assert not calls
    assert not math.isnan(timings["sdpa"])


# ---- the same attention as sdpa ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "group"),
    [(torch.float32, 7), (torch.float32, 2), (torch.float32, 1), (torch.bfloat16, 7)],
)
def test_flex_equals_sdpa_on_strided_padded_views(dtype: torch.dtype, group: int) -> None:
    scale = GROUPS[group][2] ** -0.5
    for width in WIDTHS:  # one compile: the width is symbolic
        q, k, v, mask = inputs(group=group, width=width, dtype=dtype)
        with torch.inference_mode():
            out = decode_attention_flex(q, k, v, mask, scale)
        assert_agrees(out, decode_attention(q, k, v, mask, scale))
    assert attention._flex_compiled().compiled is not None  # compiled, not the eager fallback


@pytest.mark.parametrize("head_dim", [8, 16])
def test_small_head_dims_run_flex_eagerly_on_the_cpu(head_dim: int) -> None:
    """Below CPU_FLEX_MIN_HEAD_DIM the CPU's compiled flex kernel was wrong (0.3-0.6 off sdpa
    on an AVX2 CPU, torch 2.13): flex's eager reference serves them, nothing is compiled."""
    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn((ROWS, 4, head_dim), generator=g)
    k, v = (torch.randn((2, ROWS + 3, 2, 240, head_dim), generator=g)[1, :ROWS, :, :200]
            for _ in range(2))  # fmt: skip
    mask = torch.zeros((ROWS, 200))
    mask[:, 150:] = float("-inf")
    assert not attention.flex_compiles_correctly(torch.device("cpu"), head_dim)
    assert attention.flex_compiles_correctly(torch.device("cuda"), head_dim) == (
        head_dim >= attention.CUDA_FLEX_MIN_HEAD_DIM
    )
    before = compiled_graphs()
    with torch.inference_mode():
        out = decode_attention_flex(q, k, v, mask, head_dim**-0.5)
        assert_agrees(out, decode_attention(q, k, v, mask, head_dim**-0.5))
    assert compiled_graphs() == before


def test_a_masked_column_has_probability_zero() -> None:
    """Whatever a -inf column holds (stale K/V of an earlier request) changes nothing, and a
    row with one real column returns that column's V exactly."""
    q, k, v, mask = inputs()
    only = torch.full_like(mask, float("-inf"))
    only[:, 9] = 0
    with torch.inference_mode():
        before = decode_attention_flex(q, k, v, mask, 0.125)
        one_column = decode_attention_flex(q, k, v, only, 0.125)
    heads, kv_heads, _ = GROUPS[7]
    expected = v[:, :, 9].repeat_interleave(heads // kv_heads, dim=1)  # (b, H, D)
    torch.testing.assert_close(one_column, expected)
    masked = torch.isinf(mask)[:, None, :, None].expand_as(k)
    k[masked], v[masked] = 1e4, -1e4  # in the views: the same layout, the same code
    with torch.inference_mode():
        torch.testing.assert_close(decode_attention_flex(q, k, v, mask, 0.125), before)


# ---- compiling -----------------------------------------------------------------------------


def flex_against_sdpa(**shape) -> None:
    q, k, v, mask = inputs(**shape)
    with torch.inference_mode():
        assert_agrees(decode_attention_flex(q, k, v, mask, 0.125),
                      decode_attention(q, k, v, mask, 0.125))  # fmt: skip


def test_flex_compiles_whole_once_per_batch_size(caplog) -> None:
    """fullgraph (a graph break would raise; the wrapper would fall back to eager and warn).
    What recompiles: a new width or cache layout reuses the batch size's code (both symbolic);
    a new batch size compiles once more, as the engine's warm-up does per batch bucket (flex's
    decoding kernel needs a static batch); and so does the first layer's cache view, whose
    storage offset 0 dynamo specialises (its 0/1 rule), so the engine builds two per bucket."""
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    with caplog.at_level(logging.WARNING, logger="rollserve.generation"):
        flex_against_sdpa(width=WIDTHS[0])
        compiled = compiled_graphs()
        for width in (128, 333):  # other widths, other layouts (the buffer is width + 40 wide)
            flex_against_sdpa(width=width)
        assert compiled_graphs() == compiled  # no recompile for a width
        flex_against_sdpa(width=WIDTHS[0], layer=0)
        assert compiled_graphs() == compiled + 1  # offset 0: one more
        flex_against_sdpa(width=WIDTHS[1], layer=0)
        flex_against_sdpa(rows=ROWS + 2, width=WIDTHS[0])
        assert compiled_graphs() == compiled + 2  # a batch size: one more
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks
    assert attention._flex_compiled().compiled is not None
    assert "torch.compile of" not in caplog.text


# ---- the engine ---------------------------------------------------------------------------


def test_the_environment_forces_flex_and_greedy_tokens_do_not_change(monkeypatch) -> None:
    """ROLLSERVE_DECODE_ATTENTION=flex on a CPU engine (a tiny GQA Qwen2, 4 heads per 2 KV
    heads, head_dim 16): the decode steps run it, and greedy decoding matches sdpa's."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids, mask = left_pad(PROMPTS, PAD, torch.device("cpu"))
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    results = {}
    for name in ("sdpa", "flex"):
        monkeypatch.setenv(DECODE_ATTENTION_ENV, name)
        engine = Engine(model, read_family(model))
        assert engine.decode_attention == name
        results[name] = engine.generate(ids, mask, params, pad_token_id=PAD,
                                        generator=torch.Generator())  # fmt: skip
    assert results["flex"].response_mask.all()
    assert torch.equal(results["flex"].response, results["sdpa"].response)
    torch.testing.assert_close(results["flex"].log_probs, results["sdpa"].log_probs, atol=1e-5,
                               rtol=0)  # fmt: skip


# ---- CUDA ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_flex_is_timed_matches_sdpa_and_captures() -> None:
    """Qwen2-0.5B's decode shape in bfloat16 (14 heads per 2 KV heads, head_dim 64), 512 rows
    of strided cache views: the pick times flex (a number, not NaN: it compiled, agreed with
    sdpa and captured); another width, not a multiple of 128, reuses its code and agrees;
    a call never synchronises nor copies the cache views; a captured call reads the cache as
    it is at replay."""
    device = torch.device("cuda")
    with torch.inference_mode():
        q, k, v, mask = inputs(512, 7, 384, torch.bfloat16, "cuda")
        name, timings = pick_decode_attention(q, k, v, mask, 0.125)
        print(timings, "->", name)
        assert list(timings) == [*DECODE_ATTENTION, "flex"]
        assert timings["flex"] > 0, "flex failed or disagreed: see the warning logged"
        compiled = compiled_graphs()
        q, k, v, mask = inputs(512, 7, 300, torch.bfloat16, "cuda")
        assert_agrees(decode_attention_flex(q, k, v, mask, 0.125),
                      decode_attention(q, k, v, mask, 0.125))  # fmt: skip
        assert compiled_graphs() == compiled, "a new width recompiled on CUDA"
        assert attention._flex_compiled().compiled is not None
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.set_sync_debug_mode("error")  # a host sync raises
        try:
            out = decode_attention_flex(q, k, v, mask, 0.125)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        # No copy of the cache views: the call's temporaries are far below one K view's bytes.
        extra = torch.cuda.max_memory_allocated(device) - before
        assert extra < k.numel() * k.element_size() // 4, extra
        torch.testing.assert_close(out, decode_attention_flex(q, k, v, mask, 0.125))
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            decode_attention_flex(q, k, v, mask, 0.125)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = decode_attention_flex(q, k, v, mask, 0.125)
        k.normal_()  # the cache views change in place (the next token's K/V)
        v.normal_()
        graph.replay()
        torch.cuda.synchronize(device)
        assert_agrees(captured, decode_attention(q, k, v, mask, 0.125))


@pytest.mark.gpu
def test_on_cuda_a_head_dim_flex_refuses_runs_the_matmul_form_and_captures() -> None:
    """Below CUDA_FLEX_MIN_HEAD_DIM Inductor's CUDA flex kernel refuses the shape and flex's
    eager form cannot be captured (it copies from host memory): the "flex" variant runs the
    matmul one there, which a CUDA graph captures, compiling nothing."""
    device = torch.device("cuda")
    head_dim = 8
    assert head_dim < attention.CUDA_FLEX_MIN_HEAD_DIM
    g = torch.Generator(device=device).manual_seed(8)
    q = torch.randn((ROWS, 4, head_dim), generator=g, device=device).bfloat16()
    k, v = (torch.randn((ROWS + 3, 2, 240, head_dim), generator=g, device=device).bfloat16()[
        :ROWS, :, :200] for _ in range(2))  # fmt: skip
    mask = torch.zeros((ROWS, 200), device=device, dtype=torch.bfloat16)
    mask[:, 150:] = float("-inf")
    before = compiled_graphs()
    with torch.inference_mode():
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            decode_attention_flex(q, k, v, mask, head_dim**-0.5)  # warm, off the capture
        torch.cuda.current_stream(device).wait_stream(side)
        with torch.cuda.graph(graph):
            captured = decode_attention_flex(q, k, v, mask, head_dim**-0.5)
        k.normal_()
        graph.replay()
        torch.cuda.synchronize(device)
        assert_agrees(captured, decode_attention(q, k, v, mask, head_dim**-0.5))
    assert compiled_graphs() == before
