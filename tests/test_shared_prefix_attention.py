"""Decode attention with a group's prompt read once (server/generation/shared_prefix.py), proved
on the CPU: it equals "sdpa" (attention.decode_attention) within the tolerance the engine's
pick holds every variant to, on strided views of a cache whose groups of consecutive rows
share their prompt columns, with left pads (a group's shared columns all pads included),
unwritten columns and rows at different lengths; query groups of 7, 2 and 1 heads per KV head;
float32 and bfloat16; both forms eagerly and traced whole (fullgraph, AOTAutograd), the gpu
tests compile them with Inductor on CUDA (Inductor's CPU flex kernel has no log-sum-exp).
"""

from __future__ import annotations

import logging

import pytest
import torch
from rollserve.server.generation.attention import (
    _tolerance,
    additive_mask,
    decode_attention,
    pick_decode_attention,
)
from rollserve.server.generation.shared_prefix import (
    SHARED_PREFIX_ATTENTION_ENV,
    SharedPrefix,
    shared_prefix_decode_attention,
    shared_prefix_variants,
)

# (query heads, KV heads, head dim): groups of 7 (Qwen2-0.5B's 14 / 2, head_dim 64), 2 and 1.
HEADS = {7: (14, 2, 64), 2: (4, 2, 16), 1: (2, 2, 16)}
PROMPT = 128  # the layout's prompt columns (left-padded prompts end at column PROMPT - 1)


def grouped_cache(
    groups: int,
    samples: int,
    group: int = 7,
    width: int = 256,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (b, H, D); k, v (b, Hkv, w, D) as the engine's cache views (layer 1 of a buffer wider
    in rows and columns: never contiguous) whose rows come in `groups` groups of `samples`
    sharing their PROMPT prompt columns; the additive mask (b, w): each group's left pads (one
    group's prompt shorter than 64 columns: its first 64 columns are all pads), then each row's
    own count of generated columns."""
    heads, kv_heads, dim = HEADS[group]
    rows = groups * samples
    g = torch.Generator(device=device).manual_seed(rows * 100 + group)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device).to(dtype)

    layout = (2, rows + 3, kv_heads, width + 64, dim)
    k_buffer, v_buffer = randn(*layout), randn(*layout)
    for buffer in (k_buffer, v_buffer):  # a group's prompt columns: the same K/V in each row
        prompt = buffer[1, :rows:samples, :, :PROMPT]
        buffer[1, :rows, :, :PROMPT] = prompt.repeat_interleave(samples, dim=0)
    k, v = k_buffer[1, :rows, :, :width], v_buffer[1, :rows, :, :width]
    assert not k.is_contiguous()
    prompt_lengths = torch.tensor([PROMPT, 30, 100, 65], device=device)
    lengths = prompt_lengths.repeat(-(-groups // 4))[:groups].repeat_interleave(samples)
    generated = torch.arange(rows, device=device) * 37 % (width - PROMPT) + 1
    columns = torch.arange(width, device=device)
    allowed = (columns >= PROMPT - lengths[:, None]) & (columns < PROMPT + generated[:, None])
    return randn(rows, heads, dim), k, v, additive_mask(allowed, dtype)


def assert_agrees(out: torch.Tensor, reference: torch.Tensor) -> None:
    tol = _tolerance(reference.dtype)
    assert out.shape == reference.shape and out.dtype == reference.dtype
    torch.testing.assert_close(out.float(), reference.float(), rtol=tol, atol=tol)


def test_of_layout_rounds_the_prompt_down_and_shares_nothing_alone() -> None:
    assert SharedPrefix.of_layout(8, 128) == SharedPrefix(8, 128)
    assert SharedPrefix.of_layout(8, 200) == SharedPrefix(8, 192)
    assert SharedPrefix.of_layout(1, 512) is None  # one sample per prompt
    assert SharedPrefix.of_layout(8, 63) is None  # nothing of a whole quantum
    # The case at its widest step: 64 groups x 128 columns + 512 rows x 256.
    assert SharedPrefix(8, 128).columns_read(512, 384) == 64 * 128 + 512 * 256


@pytest.mark.parametrize("form", ["matmul", "flex"])
@pytest.mark.parametrize(
    ("dtype", "group", "samples", "prefix"),
    [
        (torch.float32, 7, 4, 128),
        (torch.float32, 7, 2, 64),
        (torch.float32, 2, 4, 128),
        (torch.float32, 1, 3, 64),
        (torch.bfloat16, 7, 4, 128),
    ],
)
def test_equals_sdpa_on_a_grouped_cache(
    form: str, dtype: torch.dtype, group: int, samples: int, prefix: int
) -> None:
    scale = HEADS[group][2] ** -0.5
    q, k, v, mask = grouped_cache(4, samples, group, dtype=dtype)
    with torch.inference_mode():
        out = shared_prefix_decode_attention(q, k, v, mask, scale, form=form, samples=samples,
                                             prefix=prefix)  # fmt: skip
        assert_agrees(out, decode_attention(q, k, v, mask, scale))


@pytest.mark.parametrize("form", ["matmul", "flex"])
def test_each_form_traces_whole(form: str) -> None:
    """fullgraph under dynamo and AOTAutograd (the graph Inductor compiles; a second or two,
    where Inductor's CPU code for the matmul form takes ~25 s cold): no host synchronisation and
    no data-dependent Python, so a CUDA graph can replay it. The gpu tests compile both forms
    with Inductor on CUDA."""
    torch._dynamo.reset()
    q, k, v, mask = grouped_cache(2, 4, 2)
    traced = torch.compile(shared_prefix_decode_attention, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        out = traced(q, k, v, mask, 0.25, form=form, samples=4, prefix=128)
        assert_agrees(out, decode_attention(q, k, v, mask, 0.25))


def test_the_shared_columns_are_read_from_each_groups_first_row() -> None:
    """The precondition made visible: the prefix part reads row 0 of each group only, so a
    row whose prompt columns differ from its group's first row gets the first row's prompt
    (a layout that is not grouped must not use this attention)."""
    q, k, v, mask = grouped_cache(2, 4, 2)
    k[1, :, :, :64] += 1.0  # row 1 (not a group's first) changed in the shared columns
    with torch.inference_mode():
        out = shared_prefix_decode_attention(q, k, v, mask, 0.25, form="matmul", samples=4,
                                             prefix=64)  # fmt: skip
        plain = decode_attention(q, k, v, mask, 0.25)
    assert not torch.allclose(out[1], plain[1], atol=1e-3)
    torch.testing.assert_close(out[4:], plain[4:], rtol=1e-5, atol=1e-5)  # the other group


def test_the_pick_times_the_shared_forms_against_the_plain_ones() -> None:
    q, k, v, mask = grouped_cache(4, 4, 2)
    shared = SharedPrefix.of_layout(4, PROMPT)
    variants = shared_prefix_variants(shared, torch.device("cpu"), compiled=False)
    assert list(variants) == ["matmul_shared"]  # flex_shared: compiled on CUDA only
    on_cuda = shared_prefix_variants(shared, torch.device("cuda"), compiled=True)
    assert list(on_cuda) == ["matmul_shared", "flex_shared"]
    with torch.inference_mode():
        name, timings = pick_decode_attention(
            q, k, v, mask, 0.25, repeats=3, variants={"sdpa": decode_attention, **variants}
        )
    assert set(timings) == {"sdpa", "matmul_shared"} and name in timings
    assert all(ms == ms for ms in timings.values()), timings  # both ran and agreed (not NaN)


@pytest.mark.gpu
def test_flex_shared_compiled_on_cuda_equals_sdpa() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v, mask = grouped_cache(64, 8, 7, width=384, dtype=torch.bfloat16, device="cuda")
    with torch.inference_mode():
        reference = decode_attention(q, k, v, mask, 0.125)
        for form in ("flex", "matmul"):
            out = shared_prefix_decode_attention(q, k, v, mask, 0.125, form=form, samples=8,
                                                 prefix=128, compiled=True)  # fmt: skip
            assert_agrees(out, reference)


@pytest.mark.gpu
def test_flex_shared_under_head_dim_16_on_cuda_runs_the_matmul_form(caplog) -> None:
    """Inductor's CUDA flex kernel refuses a head_dim under 16, and flex's eager fallback
    cannot be captured: the flex form runs the matmul one there, nothing fails to compile."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v, mask = grouped_cache(4, 4, 2, device="cuda")  # head_dim 16: narrowed to 8
    q, k, v = q[..., :8].contiguous(), k[..., :8], v[..., :8]
    options = dict(samples=4, prefix=PROMPT)
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        expected = shared_prefix_decode_attention(q, k, v, mask, 0.35, form="matmul", **options)
        out = shared_prefix_decode_attention(q, k, v, mask, 0.35, form="flex", compiled=True,
                                             **options)  # fmt: skip
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text
    assert_agrees(out, expected)


# ---- in the engine (ROLLSERVE_SHARED_PREFIX_ATTENTION) -----------------------------------------

ENGINE_VOCAB = 96
STOP_TOKENS = tuple(range(88, 96))  # an eighth of the vocabulary: rows stop at many steps


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def tiny_model(request, tmp_path_factory: pytest.TempPathFactory):
    """A tiny causal LM saved and loaded from disk in float32 (Mistral with a sliding window
    shorter than the shared columns, so the windowed mask of those columns matters); head_dim
    16, the least that Inductor's CUDA flex kernel takes (flex_shared is compiled on CUDA)."""
    import transformers as tf

    common = dict(
        vocab_size=ENGINE_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    configs = {
        "llama": lambda: tf.LlamaConfig(**common),
        "qwen2": lambda: tf.Qwen2Config(**common),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=80),
    }
    torch.manual_seed(3)
    built = tf.AutoModelForCausalLM.from_config(configs[request.param]())
    built.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp(request.param)
    built.save_pretrained(path)
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def grouped_prompts(samples: int, lengths=(70, 66, 100)) -> torch.Tensor:
    """(prompts x samples, longest) left-padded ids and their mask: each prompt's rows together."""
    from rollserve.server.experience.generation import left_pad

    g = torch.Generator().manual_seed(sum(lengths))
    prompts = [torch.randint(1, 60, (n,), generator=g).tolist() for n in lengths]
    return left_pad([p for p in prompts for _ in range(samples)], 0, torch.device("cpu"))


def engine_run(model, monkeypatch, shared: str | None, ids, mask, **params):
    from rollserve.server.experience.generation import SamplingParams
    from rollserve.server.generation import Engine, read_family

    if shared is None:
        monkeypatch.delenv(SHARED_PREFIX_ATTENTION_ENV, raising=False)
    else:
        monkeypatch.setenv(SHARED_PREFIX_ATTENTION_ENV, shared)
    engine = Engine(model, read_family(model), kv_cache_tokens=8192)
    result = engine.generate(
        ids, mask, SamplingParams(**params), pad_token_id=0,
        generator=torch.Generator().manual_seed(7),
    )  # fmt: skip
    (ws,) = engine._workspaces.values()
    return result, ws.shapes


def assert_same_generation(ours, plain) -> None:
    assert torch.equal(ours.response, plain.response)
    assert torch.equal(ours.response_mask, plain.response_mask)
    assert torch.equal(ours.stopped, plain.stopped)
    torch.testing.assert_close(ours.log_probs, plain.log_probs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grouped_requests_generate_what_the_plain_engine_does(
    tiny_model, monkeypatch, temperature: float
) -> None:
    """3 prompts x 4 samples, left-padded to 100 columns: the first 64 are read once per group;
    greedy and seeded sampling give the plain engine's tokens and log-probs, and the steps ran
    shared (their shapes carry the split)."""
    ids, mask = grouped_prompts(4)
    options = dict(max_new_tokens=20, temperature=temperature)
    plain, plain_shapes = engine_run(tiny_model, monkeypatch, None, ids, mask, **options)
    ours, shapes = engine_run(tiny_model, monkeypatch, "matmul_shared", ids, mask, **options)
    assert_same_generation(ours, plain)
    assert shapes == {(b, w, 4, 64) for b, w in plain_shapes}


def test_rows_that_finish_turn_the_batch_back_to_plain_steps(tiny_model, monkeypatch) -> None:
    """With stop tokens rows finish at different steps; once the live rows move to a smaller
    bucket they are no longer whole groups, and the steps after run the plain attention; the
    results are the plain engine's throughout."""
    ids, mask = grouped_prompts(8)  # 24 rows: bucket 24, then 16, 8, ... as rows stop
    options = dict(max_new_tokens=40, temperature=1.0, stop_sequences=[[t] for t in STOP_TOKENS])
    plain, _ = engine_run(tiny_model, monkeypatch, None, ids, mask, **options)
    ours, shapes = engine_run(tiny_model, monkeypatch, "matmul_shared", ids, mask, **options)
    assert_same_generation(ours, plain)
    assert 0 < plain.stopped.sum() and plain.response_mask.sum(1).unique().numel() > 2
    assert any(len(key) == 4 for key in shapes) and any(len(key) == 2 for key in shapes), shapes


def test_batches_that_are_not_groups_run_the_plain_attention(tiny_model, monkeypatch) -> None:
    ids, mask = grouped_prompts(1, lengths=(70, 66, 100, 90))  # one sample per prompt
    ours, shapes = engine_run(
        tiny_model, monkeypatch, "matmul_shared", ids, mask, max_new_tokens=4, temperature=0.0
    )
    assert shapes and all(len(key) == 2 for key in shapes)
    ids, mask = grouped_prompts(3)  # groups of 3 rows: 9 rows in a bucket of 16
    _, shapes = engine_run(
        tiny_model, monkeypatch, "matmul_shared", ids, mask, max_new_tokens=4, temperature=0.0
    )
    assert shapes and all(len(key) == 2 for key in shapes)


def test_an_unknown_shared_attention_name_is_refused(tiny_model, monkeypatch) -> None:
    from rollserve.server.generation import Engine, read_family

    monkeypatch.setenv(SHARED_PREFIX_ATTENTION_ENV, "nope")
    with pytest.raises(ValueError, match="ROLLSERVE_SHARED_PREFIX_ATTENTION='nope'"):
        Engine(tiny_model, read_family(tiny_model), kv_cache_tokens=1024)
    monkeypatch.setenv(SHARED_PREFIX_ATTENTION_ENV, "off")
    assert (
        Engine(tiny_model, read_family(tiny_model), kv_cache_tokens=1024).shared_attention is None
    )


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["matmul_shared", "flex_shared"])
def test_the_cuda_engine_captures_shared_steps_that_generate_the_plain_tokens(
    tiny_model, monkeypatch, name: str
) -> None:
    """On CUDA (compiled layers, CUDA graphs), float32: each shared-prefix attention compiles,
    is captured and replays to the plain engine's greedy tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import copy

    model = copy.deepcopy(tiny_model).cuda()
    ids, mask = (t.cuda() for t in grouped_prompts(4))
    options = dict(max_new_tokens=16, temperature=0.0)
    plain, plain_shapes = engine_run(model, monkeypatch, None, ids, mask, **options)
    ours, shapes = engine_run(model, monkeypatch, name, ids, mask, **options)
    assert torch.equal(ours.response, plain.response)
    torch.testing.assert_close(ours.log_probs, plain.log_probs, rtol=1e-4, atol=1e-4)
    assert shapes == {(b, w, 4, 64) for b, w in plain_shapes}


def test_the_warm_up_builds_the_shared_steps_of_groups_of_eight(tiny_model, monkeypatch) -> None:
    """With a shared-prefix attention the warm-up also runs each bucket's steps for groups of
    WARM_UP_SAMPLES rows: a request of 8 samples per prompt then runs no step it did not."""
    from rollserve.server.experience.generation import SamplingParams
    from rollserve.server.generation import Engine, read_family
    from rollserve.server.generation.runner import WARM_UP_SAMPLES

    assert WARM_UP_SAMPLES == 8
    monkeypatch.setenv(SHARED_PREFIX_ATTENTION_ENV, "matmul_shared")
    engine = Engine(tiny_model, read_family(tiny_model), kv_cache_tokens=8192)
    params = SamplingParams(max_new_tokens=20, temperature=1.0)
    engine.warm_up(params, 24, 100, pad_token_id=0)
    (ws,) = engine._workspaces.values()
    warmed = set(ws.shapes)
    assert {key[0] for key in warmed if len(key) == 4} == {24, 16, 8}  # buckets of whole groups
    ids, mask = grouped_prompts(8)  # 3 prompts x 8, 100 columns
    engine.generate(ids, mask, params, pad_token_id=0, generator=torch.Generator().manual_seed(1))
    assert any(len(key) == 4 for key in ws.shapes) and ws.shapes == warmed
