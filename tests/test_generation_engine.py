"""rollserve's generation engine (server/generation) on the CPU, against the HF models it reads.

Tiny Llama, Qwen2, Qwen3 and Mistral configs (and rope-scaled Llamas) are built, saved and
loaded from disk in float32. Every test pins path="rollserve" (the default on the CPU is the
HF path) or calls the Engine directly.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from helpers_generation import expected_cut, responses
from rollserve.server.experience.generation import GenerationOutput, SamplingParams, generate
from rollserve.server.experience.generation import left_pad as pad_prompts
from rollserve.server.experience.scoring import action_log_probs
from rollserve.server.generation import Engine, engine_for, engine_path, read_family

PAD = 0
VOCAB = 96
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33], [40], [50, 51, 52, 53, 54, 55]]
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD,
    bos_token_id=None, eos_token_id=None,
)  # fmt: skip


def _config(name: str):
    import transformers as tf

    rope = {"rope_theta": 10000.0}
    if name == "llama":
        return tf.LlamaConfig(**COMMON)
    if name == "llama_linear_rope":
        return tf.LlamaConfig(
            **COMMON, rope_parameters={**rope, "rope_type": "linear", "factor": 2.0}
        )
    if name == "llama3_rope":
        llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
        return tf.LlamaConfig(**COMMON, rope_parameters={**rope, **llama3})
    if name == "qwen2":
        return tf.Qwen2Config(**COMMON)
    if name == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True)
    if name == "mistral":  # a window shorter than the sequences, so it matters
        return tf.MistralConfig(**COMMON, sliding_window=6)
    raise KeyError(name)


FAMILIES = ["llama", "llama_linear_rope", "llama3_rope", "qwen2", "qwen3", "mistral"]


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(FAMILIES.index(request.param))
    built = AutoModelForCausalLM.from_config(_config(request.param))
    with torch.no_grad():  # random biases and norm weights, so that reading them matters
        for name, tensor in built.named_parameters():
            if name.endswith("bias") or "norm" in name:
                tensor.add_(torch.randn_like(tensor) * 0.2)
    built.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp(request.param)
    built.save_pretrained(path)
    return _load(path)


def run(model, params: SamplingParams, seed: int = 0, prompts=PROMPTS, **kw) -> GenerationOutput:
    generator = torch.Generator().manual_seed(seed)
    return generate(
        model, prompts, params, pad_token_id=PAD, generator=generator, path="rollserve", **kw
    )


def rescored(model, out: GenerationOutput, temperature: float | None = None) -> torch.Tensor:
    scores, _ = action_log_probs(
        model, out.sequences, out.attention_mask, out.action_mask.shape[1],
        forward_batch_size=4, temperature=temperature,
    )  # fmt: skip
    return scores


# ---- forward and greedy parity with HF -----------------------------------------------------


def test_prefill_logits_equal_hf_logits_on_left_padded_rows(model) -> None:
    engine = Engine(model, read_family(model))
    ids, mask = pad_prompts(PROMPTS + [list(range(60, 90))], PAD, torch.device("cpu"))
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.inference_mode():
        theirs = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits
        hidden = engine.forward.prefill(ids, mask, positions, lambda *kv: None)
        mine = engine.forward.logits(hidden)
    torch.testing.assert_close(mine[mask], theirs[mask], atol=1e-5, rtol=1e-5)


LONG_PROMPTS = PROMPTS + [list(range(60, 90))]


def prefill_equals_hf(model) -> torch.Tensor:
    """The engine's prefill of LONG_PROMPTS gives HF's logits at every real column; HF's greedy
    tokens after them (12 new), for the caller to check generation against."""
    ids, mask = pad_prompts(LONG_PROMPTS, PAD, torch.device("cpu"))
    engine = Engine(model, read_family(model))
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.inference_mode():
        theirs = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits
        mine = engine.forward.logits(engine.forward.prefill(ids, mask, positions, None))
        hf = model.generate(
            input_ids=ids, attention_mask=mask.long(), do_sample=False, pad_token_id=PAD,
            max_new_tokens=12, eos_token_id=None,
        )  # fmt: skip
    torch.testing.assert_close(mine[mask], theirs[mask], atol=1e-5, rtol=1e-5)
    return hf


def test_a_prefill_past_the_mask_bound_runs_in_blocks_of_queries(
    model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts whose whole mask passes attention.MASK_BYTES (here: a bound of 3 queries of the
    widest batch) prefill block by block: HF's logits, and HF's greedy tokens after them."""
    from rollserve.server.generation import attention, causal_rows

    monkeypatch.setenv(causal_rows.CAUSAL_MIN_COLUMNS_ENV, str(1 << 30))  # the masked route
    ids, _ = pad_prompts(LONG_PROMPTS, PAD, torch.device("cpu"))
    per_query = ids.shape[0] * ids.shape[1] * (4 + attention.MASK_BUILD_BYTES)
    monkeypatch.setattr(attention, "MASK_BYTES", 3 * per_query)
    assert len(attention.query_blocks(*ids.shape[:1], 0, ids.shape[1], torch.float32)) == 10
    hf = prefill_equals_hf(model)
    ours = run(model, SamplingParams(max_new_tokens=12, temperature=0.0), prompts=LONG_PROMPTS)
    assert torch.equal(ours.sequences, hf)


def test_a_long_prefill_attends_causally_with_hf_logits_and_greedy_tokens(
    model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts past causal_rows.CAUSAL_MIN_COLUMNS (here: every prompt) prefill causally over
    rolled rows (left pads last, no mask): HF's logits at every real column, HF's greedy
    tokens after them (the K/V written to the cache are the rows' own, in their layout); a
    family whose window is shorter than the prompts keeps the masks."""
    from rollserve.server.generation import causal_rows
    from rollserve.server.generation import model as generation_model

    monkeypatch.setenv(causal_rows.CAUSAL_MIN_COLUMNS_ENV, "0")
    calls: list[bool] = []

    def counted(q, k, v, rows, scale):
        calls.append(rows.pads is None)  # left pads only: nothing to suppress
        return causal_rows.causal_attention(q, k, v, rows, scale)

    monkeypatch.setattr(generation_model, "causal_attention", counted)
    hf = prefill_equals_hf(model)
    window = read_family(model).layers[0].window
    width = max(map(len, LONG_PROMPTS))
    assert (calls != []) == (window is None or window >= width)
    assert all(calls)
    calls.clear()
    ours = run(model, SamplingParams(max_new_tokens=12, temperature=0.0), prompts=LONG_PROMPTS)
    assert torch.equal(ours.sequences, hf)
    assert calls or window is not None


def test_greedy_equals_hf_generate(model) -> None:
    """40 new tokens: decode steps cross the Mistral window and several attention widths."""
    ids, mask = pad_prompts(PROMPTS, PAD, torch.device("cpu"))
    with torch.inference_mode():
        theirs = model.generate(
            input_ids=ids, attention_mask=mask.long(), do_sample=False, pad_token_id=PAD,
            max_new_tokens=40, eos_token_id=None,
        )  # fmt: skip
    ours = run(model, SamplingParams(max_new_tokens=40, temperature=0.0))
    assert torch.equal(ours.sequences, theirs)
    assert ours.truncated.all()


@pytest.mark.parametrize("tempered", [False, True])
def test_sampled_log_probs_equal_teacher_forced_rescoring(model, tempered: bool) -> None:
    stops = tuple((t,) for t in range(3, VOCAB, 19)) + ((40, 41),)  # rows stop at various steps
    params = SamplingParams(
        max_new_tokens=30, temperature=0.7, top_k=20, top_p=0.9, stop_sequences=stops,
        logprobs_use_temperature=tempered,
    )  # fmt: skip
    prompts = PROMPTS + [p[::-1] + [60] for p in PROMPTS] * 2  # 15 rows: compactions
    out = run(model, params, seed=1, prompts=prompts)
    valid = out.action_mask
    assert out.response_lengths.unique().numel() > 2  # rows finished at different steps
    expected = rescored(model, out, 0.7 if tempered else None)
    torch.testing.assert_close(out.action_log_probs[valid], expected[valid], atol=1e-5, rtol=0)
    assert (out.action_log_probs[~valid] == 0).all()
    assert (out.sequences[:, out.prompt_width :][~valid] == PAD).all()


# ---- sampling semantics (on the Llama only: they do not depend on the family) -------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    built = LlamaForCausalLM(_config("llama"))
    path = tmp_path_factory.mktemp("llama")
    built.save_pretrained(path)
    return _load(path)


def test_same_seed_reproduces_and_another_seed_differs(llama) -> None:
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=50, stop_sequences=((7,),))
    first, again, other = run(llama, params, 11), run(llama, params, 11), run(llama, params, 12)
    for field in ("sequences", "attention_mask", "action_mask", "action_log_probs", "truncated"):
        assert torch.equal(getattr(first, field), getattr(again, field)), field
    assert not torch.equal(first.sequences, other.sequences)


def test_shared_prefill_equals_a_prefill_of_every_row(llama) -> None:
    prompts = [p for p in PROMPTS for _ in range(3)] + [PROMPTS[1]]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop_sequences=((9,),))
    shared = run(llama, params, 3, prompts)
    every = run(llama, params, 3, prompts, share_prefill=False)
    assert torch.equal(shared.sequences, every.sequences)
    torch.testing.assert_close(shared.action_log_probs, every.action_log_probs, atol=1e-6, rtol=0)
    assert len({tuple(r) for r in responses(shared)[:3]}) > 1  # a group's samples differ


@pytest.mark.parametrize("min_new_tokens", [0, 4])
def test_stop_sequences_cut_at_the_earliest_occurrence(llama, min_new_tokens: int) -> None:
    free = responses(run(llama, SamplingParams(max_new_tokens=24, temperature=0.0)))
    stops = (tuple(free[0][9:12]), tuple(free[2][2:4]))  # multi-token: never change sampling
    params = SamplingParams(
        max_new_tokens=24, min_new_tokens=min_new_tokens, temperature=0.0, stop_sequences=stops
    )
    out = run(llama, params)
    for row, tokens in enumerate(free):
        cut, stopped = expected_cut(tokens, stops, min_new_tokens)
        assert responses(out)[row] == cut, row
        assert bool(out.truncated[row]) is not stopped


def test_stop_sequence_may_not_reach_back_into_the_prompt(llama) -> None:
    free = responses(run(llama, SamplingParams(max_new_tokens=8, temperature=0.0)))
    row = next(
        r for r, tokens in enumerate(free)
        if (PROMPTS[r][-1], tokens[0]) not in set(zip(tokens, tokens[1:], strict=False))
    )  # fmt: skip
    across = (PROMPTS[row][-1], free[row][0])
    out = run(llama, SamplingParams(max_new_tokens=8, temperature=0.0, stop_sequences=(across,)))
    assert responses(out)[row] == free[row] and out.truncated[row]


def test_min_new_tokens_bans_single_token_stops(llama) -> None:
    stops = tuple((t,) for t in range(3, 80))  # most of the vocabulary stops a row
    quick = run(llama, SamplingParams(max_new_tokens=16, stop_sequences=stops))
    assert int(quick.response_lengths.max()) < 5
    for seed in range(3):
        params = SamplingParams(max_new_tokens=16, min_new_tokens=5, stop_sequences=stops)
        out = run(llama, params, seed)
        for row, tokens in enumerate(responses(out)):
            assert all(t >= 80 or t < 3 for t in tokens[:5]), tokens
            if not out.truncated[row]:
                assert len(tokens) >= 6 and 3 <= tokens[-1] < 80


def test_sampled_tokens_lie_inside_top_k_and_nucleus(llama) -> None:
    top_k, top_p, temperature = 4, 0.6, 1.5
    params = SamplingParams(max_new_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p)
    out = run(llama, params, seed=3)
    with torch.inference_mode():
        logits = llama(
            input_ids=out.sequences, attention_mask=out.attention_mask,
            position_ids=(out.attention_mask.long().cumsum(-1) - 1).clamp_min(0),
        ).logits[:, out.prompt_width - 1 : -1] / temperature  # fmt: skip
    picked = logits.gather(-1, out.sequences[:, out.prompt_width :, None])
    rank = (logits > picked).sum(-1)
    assert (rank[out.action_mask] < top_k).all()
    probs = torch.topk(logits, top_k, dim=-1).values.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    at_pick = mass_before.gather(-1, rank.clamp_max(top_k - 1)[..., None]).squeeze(-1)
    assert (at_pick[out.action_mask] < top_p + 1e-5).all()
    assert (rank[out.action_mask] > 0).any()


def test_sampling_frequencies_follow_the_distribution(llama) -> None:
    prompts = [[40, 41, 42]] * 3000
    out = run(llama, SamplingParams(max_new_tokens=1, temperature=1.0, top_k=5), prompts=prompts)
    with torch.inference_mode():
        logits = llama(input_ids=torch.tensor(prompts[:1])).logits[0, -1]
    top = torch.topk(logits, 5)
    counts = torch.stack([(out.sequences[:, -1] == t).sum() for t in top.indices]).float()
    assert counts.sum() == len(prompts)
    torch.testing.assert_close(counts / len(prompts), top.values.softmax(-1), atol=0.03, rtol=0)


# ---- static step, budget, paths, weights ---------------------------------------------------


def test_decode_step_compiles_with_fullgraph(llama) -> None:
    """torch.compile(fullgraph=True) traces the step: no host sync, no data-dependent Python."""
    engine = Engine(llama, read_family(llama))
    params = SamplingParams(
        max_new_tokens=12, min_new_tokens=2, temperature=0.9, top_k=10, top_p=0.9,
        stop_sequences=((7,), (8, 9)),
    )  # fmt: skip
    ids, mask = pad_prompts(PROMPTS, PAD, torch.device("cpu"))
    uniform = torch.rand((len(PROMPTS), 12), generator=torch.Generator().manual_seed(0))
    outputs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        with torch.inference_mode():
            ws = engine.workspace(len(PROMPTS), ids.shape[1], params, PAD)
            b = engine.start(ws, ids, mask, uniform.double(), 12, share=True)
            step = functools.partial(engine.decode_step, ws, b, ws.width)
            if compiled:
                step = torch.compile(step, fullgraph=True, backend="aot_eager")
            for _ in range(11):
                step()
            outputs.append((ws.out_tokens.clone(), ws.out_log_probs.clone(), ws.finished.clone()))
    for eager, compiled in zip(*outputs, strict=True):
        torch.testing.assert_close(eager, compiled, atol=1e-6, rtol=0)


def test_request_over_the_kv_budget_is_split_with_the_same_tokens(llama) -> None:
    prompts = [p for p in PROMPTS for _ in range(4)]  # 20 rows
    params = SamplingParams(max_new_tokens=20, temperature=1.0, stop_sequences=((9,),))
    ids, mask = pad_prompts(prompts, PAD, torch.device("cpu"))
    results = []
    for tokens in (None, 3 * 128):  # room for every row / for 3 rows of 128 columns
        engine = Engine(llama, read_family(llama), kv_cache_tokens=tokens)
        results.append(
            engine.generate(
                ids, mask, params, pad_token_id=PAD, generator=torch.Generator().manual_seed(5)
            )
        )
    whole, split = results
    assert engine.cache.rows_for(128) == 3
    assert torch.equal(whole.response, split.response)
    assert torch.equal(whole.stopped, split.stopped)
    torch.testing.assert_close(whole.log_probs, split.log_probs, atol=1e-6, rtol=0)
    assert not engine.fits(ids.shape[1], 1000)  # one row over the budget: the caller uses HF


def test_unsupported_architecture_generates_on_the_hf_path(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2)).save_pretrained(
        tmp_path
    )
    gpt2 = _load(tmp_path)
    assert engine_path(gpt2, "rollserve") == "hf" and engine_for(gpt2, "rollserve") is None
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    ours = run(gpt2, params, seed=2)
    hf = generate(
        gpt2, PROMPTS, params, pad_token_id=PAD, generator=torch.Generator().manual_seed(2),
        path="hf",
    )  # fmt: skip
    assert torch.equal(ours.sequences, hf.sequences)


def test_paths(llama) -> None:
    assert engine_path(llama, "auto") == "hf"  # the CPU keeps the HF path by default
    assert engine_path(llama, "rollserve") == "rollserve"
    assert engine_path(llama, "hf") == "hf"
    assert engine_for(llama, "rollserve") is engine_for(llama, "rollserve")  # one per model
    with pytest.raises(ValueError):
        engine_path(llama, "vllm")


def test_engine_reads_the_live_parameters(tmp_path: Path) -> None:
    """In-place copies (UpdateWeights on CUDA, LoRA merges) and swapped storages (adoption on
    the CPU) both reach the engine: greedy output keeps equal to HF's after each."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    LlamaForCausalLM(_config("llama")).save_pretrained(tmp_path)
    model = _load(tmp_path)
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    before = run(model, params)
    ids, mask = pad_prompts(PROMPTS, PAD, torch.device("cpu"))

    def hf() -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(
                input_ids=ids, attention_mask=mask.long(), do_sample=False, pad_token_id=PAD,
                max_new_tokens=10, eos_token_id=None,
            )  # fmt: skip

    with torch.no_grad():
        for tensor in model.parameters():
            tensor.copy_(torch.randn_like(tensor) * 0.5)
    copied = run(model, params)
    assert not torch.equal(copied.sequences, before.sequences)
    assert torch.equal(copied.sequences, hf())
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.data = torch.randn_like(tensor) * 0.5
    swapped = run(model, params)
    assert torch.equal(swapped.sequences, hf())


def test_a_compiler_failure_falls_back_to_eager() -> None:
    from rollserve.server.generation.compiling import maybe_compiled

    def data_dependent(x: torch.Tensor) -> torch.Tensor:  # fullgraph cannot trace .item()
        return x * 2 if x.sum().item() > 0 else x

    fn = maybe_compiled(data_dependent, True)
    assert torch.equal(fn(torch.ones(3)), torch.full((3,), 2.0))
    assert fn.compiled is None  # eager from now on
    assert maybe_compiled(data_dependent, False) is data_dependent


def test_running_out_of_memory_is_no_compiler_failure() -> None:
    """A compiled function whose run fails for want of memory (a batch too large) raises it
    and keeps its compiled code: turning eager for good would make every later call slower
    and need as much memory."""
    from rollserve.server.generation.compiling import maybe_compiled

    fn = maybe_compiled(lambda x: x * 2, True)
    compiled = fn.compiled

    def out_of_memory(*args: object) -> object:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    fn.compiled = out_of_memory  # what the compiled code raises on a run that needs too much
    with pytest.raises(torch.OutOfMemoryError):
        fn(torch.ones(3))
    assert fn.compiled is out_of_memory  # not eager
    fn.compiled = compiled
    assert torch.equal(fn(torch.ones(3)), torch.full((3,), 2.0)) and fn.compiled is compiled


def test_warm_up_builds_the_workspace_later_requests_reuse(llama) -> None:
    engine = Engine(llama, read_family(llama))
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    assert engine.warm_up(params, len(PROMPTS), 7, pad_token_id=PAD) > 0
    (warmed,) = engine._workspaces.values()
    ids, mask = pad_prompts(PROMPTS, PAD, torch.device("cpu"))  # width 7, the same layout
    engine.generate(ids, mask, params, pad_token_id=PAD, generator=torch.Generator())
    assert list(engine._workspaces.values()) == [warmed]


def test_warm_up_covers_every_bucket_and_width_a_request_runs(llama) -> None:
    """Every batch bucket up to the warm-up's rows, at every attention width of the layout:
    a request of that shape (rows finishing at different steps: compactions) runs no step
    shape the warm-up did not (on CUDA: no capture, no compile on the request path)."""
    engine = Engine(llama, read_family(llama))
    stops = tuple((t,) for t in range(3, VOCAB, 11))
    params = SamplingParams(max_new_tokens=140, temperature=1.0, stop_sequences=stops)
    prompts = [p for p in PROMPTS for _ in range(4)]  # 20 rows, prompts of width 7
    engine.warm_up(params, len(prompts), 7, pad_token_id=PAD)
    (ws,) = engine._workspaces.values()
    widths = {64, 128, 192}  # 7 + 1 .. 7 + 139 columns, in blocks of 64 (the layout: 256)
    assert ws.shapes == {(b, w) for b in (24, 16, 8, 4, 2, 1) for w in widths}
    warmed = set(ws.shapes)
    hotter = SamplingParams(
        max_new_tokens=140, temperature=1.3, top_p=1.0, min_new_tokens=3, stop_sequences=stops
    )
    out = run(llama, hotter, seed=4, prompts=prompts)  # path="rollserve": its own engine
    assert out.response_lengths.unique().numel() > 2  # rows left the batch at different steps
    ids, mask = pad_prompts(prompts, PAD, torch.device("cpu"))
    again = engine.generate(ids, mask, hotter, pad_token_id=PAD,
                            generator=torch.Generator().manual_seed(4))  # fmt: skip
    assert list(engine._workspaces.values()) == [ws]  # other values, same workspace
    assert ws.shapes == warmed
    actions = out.sequences.shape[1] - out.prompt_width  # generate() trims to the longest
    assert torch.equal(again.response[:, :actions], out.sequences[:, out.prompt_width :])
    assert (again.response[:, actions:] == PAD).all()


def test_a_smaller_batch_of_a_warmed_layout_replays_the_warm_workspace(llama) -> None:
    """A request's last, smaller generation batch (or a smaller request) runs in the warm-up's
    workspace of more rows, whose buckets cover it: no workspace of its own to build."""
    engine = Engine(llama, read_family(llama))
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    engine.warm_up(params, 4 * len(PROMPTS), 7, pad_token_id=PAD)  # 20 rows: bucket 24
    (ws,) = engine._workspaces.values()
    warmed = set(ws.shapes)
    ids, mask = pad_prompts(PROMPTS, PAD, torch.device("cpu"))  # 5 rows of the same layout
    engine.generate(ids, mask, params, pad_token_id=PAD, generator=torch.Generator())
    assert list(engine._workspaces.values()) == [ws] and ws.shapes == warmed


def test_warm_up_covers_the_widths_of_shorter_prompts_in_its_layout(llama) -> None:
    """Prompts shorter than the warm-up's share its layout (prompt + new tokens, rounded up to
    WIDTH_QUANTUM) and so its workspace, and read narrower widths: those are built too."""
    engine = Engine(llama, read_family(llama))
    params = SamplingParams(max_new_tokens=20, temperature=1.0)
    engine.warm_up(params, len(PROMPTS), 100, pad_token_id=PAD)  # layout 128, widths 128
    (ws,) = engine._workspaces.values()
    assert ws.shapes == {(b, w) for b in (8, 4, 2, 1) for w in (64, 128)}
    warmed = set(ws.shapes)
    ids, mask = pad_prompts(PROMPTS, PAD, torch.device("cpu"))  # width 7: reads 64 columns
    engine.generate(ids, mask, params, pad_token_id=PAD, generator=torch.Generator())
    assert list(engine._workspaces.values()) == [ws] and ws.shapes == warmed


def test_a_warm_up_over_its_budget_stops_after_the_first_bucket(llama) -> None:
    engine = Engine(llama, read_family(llama))
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    engine.warm_up(params, 16, 5, pad_token_id=PAD, budget_s=0.0)
    (ws,) = engine._workspaces.values()
    assert ws.shapes == {(16, 64)}  # 5 + 1 .. 5 + 3 columns


def test_sampling_values_are_loaded_into_a_reused_workspace(llama) -> None:
    """Temperature, top-p and min_new_tokens are values the step reads: one workspace serves
    requests that differ in them, each with its own tokens (equal to a fresh engine's)."""
    stops = ((9,), (30, 31))
    settings = [
        SamplingParams(
            max_new_tokens=16,
            temperature=t,
            top_p=p,
            min_new_tokens=m,
            top_k=20,
            stop_sequences=stops,
        )  # fmt: skip
        for t, p, m in ((0.6, 0.9, 0), (1.4, 0.7, 5), (1.0, 0.95, 2))
    ]
    ids, mask = pad_prompts(PROMPTS * 3, PAD, torch.device("cpu"))
    shared = Engine(llama, read_family(llama))
    results = []
    for params in settings:
        g = torch.Generator().manual_seed(7)
        mine = shared.generate(ids, mask, params, pad_token_id=PAD, generator=g)
        fresh = Engine(llama, read_family(llama)).generate(
            ids, mask, params, pad_token_id=PAD, generator=torch.Generator().manual_seed(7)
        )
        assert torch.equal(mine.response, fresh.response)
        torch.testing.assert_close(mine.log_probs, fresh.log_probs, atol=0, rtol=0)
        results.append(mine.response)
    assert len(shared._workspaces) == 1
    assert not torch.equal(results[0], results[1])  # the values did change the sampling
    with_min = results[1][:, :5]
    assert not ((with_min == 9).any())  # min_new_tokens 5 banned the single-token stop


def test_engine_memory_reports_weights_and_the_kv_buffer(llama) -> None:
    engine = Engine(llama, read_family(llama), kv_cache_tokens=4096)
    before = engine.memory()
    assert before.weights == sum(p.numel() * 4 for p in llama.parameters())
    assert before.kv_cache == 0 and before.kv_capacity == 4096 * engine.cache.token_bytes
    run_params = SamplingParams(max_new_tokens=8, temperature=0.0)
    ids, mask = pad_prompts(PROMPTS, PAD, torch.device("cpu"))
    engine.generate(ids, mask, run_params, pad_token_id=PAD, generator=torch.Generator())
    after = engine.memory()
    # 5 rows -> bucket 8, 7 + 8 columns -> 128: K and V of every layer.
    assert after.kv_cache == 8 * 128 * engine.cache.token_bytes
    assert after.graphs == 0 and after.peak_allocated == 0  # no graphs and no CUDA figures here
    assert after.as_info()["kv_cache"] == after.kv_cache / (1 << 30)


def test_sampling_in_row_blocks_equals_sampling_each_row_alone() -> None:
    """The sampler works SAMPLE_ROWS rows at a time (bounding its temporaries): a row's token
    and log-prob do not depend on its block or its neighbours."""
    from rollserve.server.generation.sampler import SAMPLE_ROWS, Sampler

    rows = 2 * SAMPLE_ROWS + 37
    g = torch.Generator().manual_seed(0)
    logits = torch.randn((rows, VOCAB), generator=g) * 3
    uniform = torch.rand((rows,), generator=g, dtype=torch.float64)
    step = torch.tensor(2)
    params = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_new_tokens=4,
                            stop_sequences=((5,),))  # fmt: skip
    sampler = Sampler(params, VOCAB, torch.device("cpu"))
    tokens, log_probs = sampler.sample(logits, uniform, step)
    alone = [sampler.sample(logits[r : r + 1], uniform[r : r + 1], step) for r in range(rows)]
    assert torch.equal(tokens, torch.cat([t for t, _ in alone]))
    torch.testing.assert_close(log_probs, torch.cat([lp for _, lp in alone]), atol=1e-6, rtol=0)
    assert not (tokens == 5).any()  # min_new_tokens bans the single-token stop at step 2


def test_compaction_moves_the_written_columns_of_a_wider_layout(llama) -> None:
    """140 new tokens after 7-column prompts: a 256-column layout whose rows leave the batch
    while attention still reads 128 columns (compaction moves only those) and after it reads
    256; the recorded log-probs still equal teacher-forced re-scoring by HF."""
    params = SamplingParams(max_new_tokens=140, temperature=1.0, stop_sequences=((3,),))
    prompts = [p for p in PROMPTS for _ in range(6)]  # 30 rows: bucket 32
    out = run(llama, params, seed=2, prompts=prompts)
    lengths = out.response_lengths
    assert (lengths < 100).sum() > 10 and (lengths > 125).any()  # left early, and went on
    expected = rescored(llama, out)
    valid = out.action_mask
    torch.testing.assert_close(out.action_log_probs[valid], expected[valid], atol=1e-5, rtol=0)


def test_attention_widths_cover_the_live_columns_with_few_graphs() -> None:
    """A step reads at least its written columns and little more (an eighth past 1024), and a
    long layout steps through few widths (one captured graph each per bucket)."""
    from rollserve.server.generation.runner import ATTENTION_QUANTUM, attention_width

    layout = 8192
    widths = [attention_width(live, layout) for live in range(1, layout + 1)]
    for live, width in enumerate(widths, start=1):
        assert live <= width <= layout and width % ATTENTION_QUANTUM == 0
        assert width <= max(ATTENTION_QUANTUM * -(-live // ATTENTION_QUANTUM), live * 9 // 8 + 1)
    assert widths == sorted(widths)
    # 64 columns each up to 1024, then 8 widths per doubling: 40 graphs, where 128 would be 128.
    assert len(set(widths[:1024])) == 16 and len(set(widths)) == 40
    assert [attention_width(live, 384) for live in (129, 192, 193, 300, 384)] == [
        192, 192, 256, 320, 384,
    ]  # the case (128 + 256 columns): 4 widths  # fmt: skip
    assert attention_width(300, 256) == 256  # never past the layout


def test_a_freed_model_frees_its_engine() -> None:
    """The registry keys engines weakly by model: an engine must not keep its model (and with
    it the KV cache and graphs) alive."""
    import gc
    import weakref

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    engine = engine_for(model, "rollserve")
    assert engine is not None and engine.model is model
    model_ref, engine_ref = weakref.ref(model), weakref.ref(engine)
    del model, engine
    gc.collect()
    assert model_ref() is None and engine_ref() is None
