"""generate() on a real tiny Llama: log-probs vs teacher forcing, stops, HF parity, seeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_generation import expected_cut, responses
from rollserve.client.protocol.errors import InvalidArgument
from rollserve.server.experience.generation import (
    GenerationOutput,
    SamplingParams,
    generate,
    left_pad,
)
from rollserve.server.experience.scoring import action_log_probs, position_ids_from_mask

PAD = 0
# Different lengths, so rows are left-padded by 0..6 columns. Ids avoid the pad id.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33], [40], [50, 51, 52, 53, 54, 55]]


@pytest.fixture(scope="module")
def actor(tiny_actor_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_actor_dir, dtype=torch.float32).eval()


def run(actor, params: SamplingParams, seed: int = 0, prompts=PROMPTS) -> GenerationOutput:
    return generate(
        actor, prompts, params, pad_token_id=PAD, generator=torch.Generator().manual_seed(seed)
    )


def check_layout(out: GenerationOutput, prompts=PROMPTS) -> None:
    """Invariants of the row layout that every output must satisfy."""
    batch, width = len(prompts), max(map(len, prompts))
    actions = out.action_mask.shape[1]
    assert out.prompt_width == width
    assert out.sequences.shape == out.attention_mask.shape == (batch, width + actions)
    assert out.sequences.dtype == torch.int64 and out.action_log_probs.dtype == torch.float32
    assert out.attention_mask.dtype == out.action_mask.dtype == torch.bool
    assert int(out.response_lengths.max()) == actions  # A is tight
    columns = torch.arange(actions)
    assert torch.equal(out.action_mask, columns[None] < out.response_lengths[:, None])  # prefix
    assert torch.equal(out.attention_mask[:, width:], out.action_mask)
    ids, mask = left_pad(prompts, PAD, torch.device("cpu"))
    assert torch.equal(out.sequences[:, :width], ids) and torch.equal(
        out.attention_mask[:, :width], mask
    )
    assert (out.sequences[:, width:][~out.action_mask] == PAD).all()
    assert (out.action_log_probs[~out.action_mask] == 0).all()
    assert (out.action_log_probs[out.action_mask] <= 0).all()


SAMPLING_CASES = {
    "filters": SamplingParams(max_new_tokens=24, temperature=0.7, top_k=20, top_p=0.9),
    "filters_tempered": SamplingParams(
        max_new_tokens=24, temperature=0.7, top_k=20, top_p=0.9, logprobs_use_temperature=True
    ),
    "hot_tempered": SamplingParams(
        max_new_tokens=24, temperature=1.6, logprobs_use_temperature=True
    ),
    "top_p_only": SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.8),
    "greedy": SamplingParams(max_new_tokens=24, temperature=0.0),
    "greedy_flag_ignored": SamplingParams(
        max_new_tokens=24, temperature=0.0, logprobs_use_temperature=True
    ),
}


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_recorded_log_probs_equal_teacher_forced_rescoring(actor, case: str) -> None:
    base = SAMPLING_CASES[case]
    # Frequent stop tokens make rows finish at different steps (masking and cache compaction).
    stops = tuple((t,) for t in range(3, 259, 9)) + ((100, 101),)
    params = SamplingParams(**{**base.__dict__, "stop_sequences": stops})
    prompts = PROMPTS + [p[::-1] + [60] for p in PROMPTS]  # 10 rows: more cache compactions
    for seed in range(3):
        out = run(actor, params, seed, prompts)
        check_layout(out, prompts)
        temperature = params.temperature if params.logprobs_use_temperature else None
        if params.temperature == 0.0:
            temperature = None  # greedy never divides
        rescored, _ = action_log_probs(
            actor, out.sequences, out.attention_mask, out.action_mask.shape[1],
            forward_batch_size=2, temperature=temperature,
        )  # fmt: skip
        valid = out.action_mask
        torch.testing.assert_close(rescored[valid], out.action_log_probs[valid], atol=1e-5, rtol=0)


def test_log_probs_use_temperature_changes_the_numbers(actor) -> None:
    """Same seed, same tokens: only the stored log-probs differ, by the temperature rule."""
    plain = run(actor, SamplingParams(max_new_tokens=8, temperature=0.5))
    tempered = run(
        actor, SamplingParams(max_new_tokens=8, temperature=0.5, logprobs_use_temperature=True)
    )
    assert torch.equal(plain.sequences, tempered.sequences)
    assert not torch.allclose(plain.action_log_probs, tempered.action_log_probs)


def hf_generate(actor, prompts, max_new_tokens: int, **kwargs) -> torch.Tensor:
    ids, mask = left_pad(prompts, PAD, torch.device("cpu"))
    with torch.inference_mode():
        return actor.generate(
            input_ids=ids, attention_mask=mask.long(), do_sample=False, pad_token_id=PAD,
            max_new_tokens=max_new_tokens, **kwargs,
        )  # fmt: skip


def test_greedy_equals_hf_generate_with_left_padding(actor) -> None:
    ours = run(actor, SamplingParams(max_new_tokens=20, temperature=0.0))
    theirs = hf_generate(actor, PROMPTS, 20, eos_token_id=None)
    assert torch.equal(ours.sequences, theirs)
    assert ours.truncated.all()


@pytest.mark.parametrize("min_new_tokens", [0, 3, 6])
def test_greedy_with_eos_and_min_new_tokens_equals_hf_generate(actor, min_new_tokens: int) -> None:
    free = responses(run(actor, SamplingParams(max_new_tokens=20, temperature=0.0)))
    eos = free[0][2]  # a token greedy decoding really produces, so rows do stop
    params = SamplingParams(
        max_new_tokens=20, min_new_tokens=min_new_tokens, temperature=0.0, stop_sequences=((eos,),)
    )
    ours = run(actor, params)
    theirs = hf_generate(actor, PROMPTS, 20, eos_token_id=eos, min_new_tokens=min_new_tokens)
    assert torch.equal(ours.sequences, theirs)
    check_layout(ours)
    stopped = ~ours.truncated
    assert stopped[0]
    for row, tokens in enumerate(responses(ours)):
        # min_new_tokens tokens come before the stop token (HF's MinNewTokens rule).
        assert (tokens[-1] == eos) == bool(stopped[row])
        assert eos not in tokens[: max(min_new_tokens, len(tokens) - 1)]


@pytest.mark.parametrize("min_new_tokens", [0, 4])
def test_stop_sequences_earliest_occurrence_wins(actor, min_new_tokens: int) -> None:
    free = responses(run(actor, SamplingParams(max_new_tokens=24, temperature=0.0)))
    # Stops taken from the free-running output: a 3-token one late in row 0, a 2-token one
    # early in row 2 and a single token from row 3; row 1 keeps whatever they match.
    stops = (tuple(free[0][9:12]), tuple(free[2][2:4]), (free[3][5],))
    params = SamplingParams(
        max_new_tokens=24, min_new_tokens=min_new_tokens, temperature=0.0, stop_sequences=stops
    )
    # Multi-token stops never change the sampling distribution, so with no single-token stop
    # before min_new_tokens the stopped run is a prefix of the free one. The single-token stop
    # is banned before min_new_tokens, which changes greedy output: only check it when 0.
    if min_new_tokens:
        params = SamplingParams(**{**params.__dict__, "stop_sequences": stops[:2]})
    out = run(actor, params)
    check_layout(out)
    got = responses(out)
    for row, tokens in enumerate(free):
        cut, stopped = expected_cut(tokens, params.stop_sequences, min_new_tokens)
        assert got[row] == cut, row
        assert bool(out.truncated[row]) is not stopped
    assert not out.truncated[0]
    assert len(got[0]) <= 12


def test_stop_sequence_may_not_reach_back_into_the_prompt(actor) -> None:
    free = responses(run(actor, SamplingParams(max_new_tokens=8, temperature=0.0)))
    # A row whose (last prompt token, first response token) pair never recurs in its response.
    row = next(
        r for r, tokens in enumerate(free)
        if (PROMPTS[r][-1], tokens[0]) not in set(zip(tokens, tokens[1:], strict=False))
    )  # fmt: skip
    across = (PROMPTS[row][-1], free[row][0])
    out = run(actor, SamplingParams(max_new_tokens=8, temperature=0.0, stop_sequences=(across,)))
    assert responses(out)[row] == free[row] and out.truncated[row]


def test_all_rows_stopping_ends_the_loop_early(actor) -> None:
    first = responses(run(actor, SamplingParams(max_new_tokens=1, temperature=0.0)))
    stops = tuple((row[0],) for row in first)  # every row stops on its first token
    out = run(actor, SamplingParams(max_new_tokens=30, temperature=0.0, stop_sequences=stops))
    assert out.action_mask.shape == (len(PROMPTS), 1)
    assert not out.truncated.any()
    assert out.response_lengths.tolist() == [1] * len(PROMPTS)


def test_min_new_tokens_bans_single_token_stops_while_sampling(actor) -> None:
    stops = tuple((t,) for t in range(3, 200))  # most of the vocabulary stops a row
    quick = run(actor, SamplingParams(max_new_tokens=16, stop_sequences=stops))
    assert int(quick.response_lengths.max()) < 5  # rows stop almost at once without the ban
    for seed in range(3):
        out = run(
            actor, SamplingParams(max_new_tokens=16, min_new_tokens=5, stop_sequences=stops), seed
        )
        check_layout(out)
        for row, tokens in enumerate(responses(out)):
            assert all(t >= 200 or t < 3 for t in tokens[:5]), tokens
            if not out.truncated[row]:
                assert len(tokens) >= 6 and 3 <= tokens[-1] < 200


def test_same_seed_reproduces_and_another_seed_differs(actor) -> None:
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=50, stop_sequences=((7,),))
    first, again, other = run(actor, params, 11), run(actor, params, 11), run(actor, params, 12)
    for field in ("sequences", "attention_mask", "action_mask", "action_log_probs", "truncated"):
        assert torch.equal(getattr(first, field), getattr(again, field)), field
    assert not torch.equal(first.sequences, other.sequences)


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 3, "top_p": 1e-6}])
def test_degenerate_filters_sample_the_argmax(actor, filters: dict) -> None:
    greedy = run(actor, SamplingParams(max_new_tokens=12, temperature=0.0))
    sampled = run(actor, SamplingParams(max_new_tokens=12, temperature=1.3, **filters), seed=5)
    assert torch.equal(greedy.sequences, sampled.sequences)


def teacher_forced_logits(actor, out: GenerationOutput) -> torch.Tensor:
    """Logits (B, A, V) that scored each action column, from one plain forward."""
    with torch.inference_mode():
        logits = actor(
            input_ids=out.sequences, attention_mask=out.attention_mask,
            position_ids=position_ids_from_mask(out.attention_mask),
        ).logits  # fmt: skip
    return logits[:, out.prompt_width - 1 : -1]


def test_sampled_tokens_lie_inside_top_k_and_nucleus(actor) -> None:
    top_k, top_p, temperature = 4, 0.6, 1.5
    params = SamplingParams(max_new_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p)
    out = run(actor, params, seed=3)
    logits = teacher_forced_logits(actor, out) / temperature  # (B, A, V)
    tokens = out.sequences[:, out.prompt_width :]
    picked = logits.gather(-1, tokens[..., None])  # (B, A, 1)
    rank = (logits > picked).sum(-1)  # tokens strictly better than the pick
    assert (rank[out.action_mask] < top_k).all()
    probs = torch.topk(logits, top_k, dim=-1).values.softmax(-1)  # (B, A, k) nucleus in top-k
    mass_before = probs.cumsum(-1) - probs
    mass_at_pick = mass_before.gather(-1, rank.clamp_max(top_k - 1)[..., None]).squeeze(-1)
    assert (mass_at_pick[out.action_mask] < top_p + 1e-5).all()
    # With these settings sampling is not greedy: some pick is not the argmax.
    assert (rank[out.action_mask] > 0).any()


def test_sampling_frequencies_follow_the_distribution(actor) -> None:
    """One step for 4000 copies of a prompt: token frequencies match softmax(top-5 logits)."""
    prompts = [[40, 41, 42]] * 4000
    out = run(actor, SamplingParams(max_new_tokens=1, temperature=1.0, top_k=5), prompts=prompts)
    with torch.inference_mode():
        logits = actor(input_ids=torch.tensor(prompts[:1])).logits[0, -1]
    top = torch.topk(logits, 5)
    expected = top.values.softmax(-1)
    counts = torch.stack([(out.sequences[:, -1] == t).sum() for t in top.indices]).float()
    assert counts.sum() == len(prompts)  # nothing outside the top 5
    torch.testing.assert_close(counts / len(prompts), expected, atol=0.03, rtol=0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 0},
        {"min_new_tokens": -1},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"stop_sequences": ((),)},
        {"stop_sequences": ((-3,),)},
    ],
)
def test_invalid_sampling_params_are_invalid_argument(kwargs: dict) -> None:
    with pytest.raises(InvalidArgument):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompts", [[], [[5], []], [[5, 259]], [[-1]], [[3] * 600]])
def test_invalid_prompts_are_invalid_argument(actor, prompts) -> None:
    with pytest.raises(InvalidArgument):
        run(actor, SamplingParams(max_new_tokens=4), prompts=prompts)


def test_stop_ids_outside_the_vocabulary_are_invalid_argument(actor) -> None:
    with pytest.raises(InvalidArgument):
        run(actor, SamplingParams(max_new_tokens=4, min_new_tokens=2, stop_sequences=((259,),)))


# ---- prefix sharing ----------------------------------------------------------------------------


def grouped(samples: int, prompts=PROMPTS) -> list[list[int]]:
    """Each prompt repeated `samples` times consecutively: a GRPO group."""
    return [p for p in prompts for _ in range(samples)]


def prefill_rows(actor, **kwargs) -> tuple[GenerationOutput, int]:
    """generate() and the number of rows its prefill forward ran (the first forward call)."""
    seen: list[int] = []
    hook = actor.register_forward_pre_hook(
        lambda module, args, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        out = generate(actor, pad_token_id=PAD, **kwargs)
    finally:
        hook.remove()
    return out, seen[0]


@pytest.mark.parametrize("case", ["filters", "hot_tempered", "greedy"])
def test_shared_prefill_equals_a_prefill_of_every_row_for_the_same_seed(actor, case) -> None:
    stops = tuple((t,) for t in range(3, 259, 11)) + ((100, 101),)  # rows finish at different steps
    params = SamplingParams(**{**SAMPLING_CASES[case].__dict__, "stop_sequences": stops})
    # Groups of 4, plus a repeat that is not next to its twin: sharing is by content.
    prompts = grouped(4) + [PROMPTS[1], PROMPTS[3]]
    for seed in range(2):
        shared, rows = prefill_rows(
            actor, prompts=prompts, params=params, generator=torch.Generator().manual_seed(seed)
        )
        every, all_rows = prefill_rows(
            actor, prompts=prompts, params=params, share_prefill=False,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        assert (rows, all_rows) == (len(PROMPTS), len(prompts))
        # The same draws on the same logits: the same tokens. CPU matmuls on 5 rows instead of
        # 22 may round the last bit differently, so recorded log-probs agree to ~1e-7.
        for field in ("sequences", "attention_mask", "action_mask", "truncated"):
            assert torch.equal(getattr(shared, field), getattr(every, field)), field
        torch.testing.assert_close(
            shared.action_log_probs, every.action_log_probs, atol=1e-6, rtol=0
        )
        check_layout(shared, prompts)
        # Samples of a group differ (the cache is copied, not the draws).
        if case != "greedy":
            assert len({tuple(r) for r in responses(shared)[:4]}) > 1


def test_shared_prefill_log_probs_equal_teacher_forced_rescoring(actor) -> None:
    prompts = grouped(3)
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=30, stop_sequences=((9,),))
    out = run(actor, params, seed=4, prompts=prompts)
    rescored, _ = action_log_probs(
        actor, out.sequences, out.attention_mask, out.action_mask.shape[1], forward_batch_size=4
    )
    valid = out.action_mask
    torch.testing.assert_close(rescored[valid], out.action_log_probs[valid], atol=1e-5, rtol=0)


def test_distinct_prompts_prefill_every_row_once(actor) -> None:
    _, rows = prefill_rows(
        actor, prompts=PROMPTS, params=SamplingParams(max_new_tokens=2),
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert rows == len(PROMPTS)
