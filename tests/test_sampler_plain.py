"""The sampler's plain path (server/generation/sampler._plain_masses / _plain_pick) on the CPU.

With no top-k and no top-p every token is a candidate, and the sampler inverts the CDF from
block masses computed from the logits, without forming (b, V) probabilities. It must pick
what one float64 scan over softmax(score) picks (score: logits over the temperature, with the
min_new_tokens ban), give the same tokens and log-probs as the general path (_prepare +
_inverse_cdf) through Sampler.sample, never pick a banned token, and compile with fullgraph.
"""

from __future__ import annotations

import pytest
import torch
from rollserve.server.experience.generation import SamplingParams
from rollserve.server.generation.sampler import (
    CDF_BLOCK,
    SAMPLE_ROWS,
    Sampler,
    _plain_masses,
    _plain_pick,
)

QWEN_VOCAB = 151936  # not a multiple of CDF_BLOCK
VOCABS = (QWEN_VOCAB, 4 * CDF_BLOCK, 3 * CDF_BLOCK + 123, CDF_BLOCK, CDF_BLOCK + 1, 37)
JUST_BELOW_ONE = 1.0 - 2.0**-53
STEP_0 = torch.zeros((), dtype=torch.long)


def _one_scan_of_softmax(scores: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The reference: one float64 CDF over the float32 weights exp(score - max) (softmax
    unnormalised, as the sampler forms them), searchsorted (right)."""
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    cdf = weights.cumsum(-1, dtype=torch.float64)
    pick = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)
    return pick.clamp_max(scores.shape[-1] - 1)


def _uniforms(rows: int, g: torch.Generator) -> torch.Tensor:
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    edges = torch.tensor([0.0, 1e-300, 1e-12, 1e-6, 1 - 1e-6], dtype=torch.float64)
    u[: len(edges)] = edges
    return u


def _logits(kind: str, rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    scale = {"peaked": 8.0, "flat": 0.1, "usual": 3.0}[kind]
    return torch.randn(rows, vocab, generator=g) * scale


def _plain(
    logits: torch.Tensor,
    uniform: torch.Tensor,
    temperature: float = 1.0,
    single: torch.Tensor | None = None,
    step: int = 0,
    min_new_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = torch.tensor(temperature)
    step_t, min_t = torch.tensor(step), torch.tensor(min_new_tokens)
    masses, top, lse = _plain_masses(logits, step_t, t, min_t, single, False)
    pick = _plain_pick(logits, masses, top, uniform, step_t, t, min_t, single)
    return pick, masses, lse


@pytest.mark.parametrize("kind", ["peaked", "flat", "usual"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_plain_pick_equals_one_float64_scan_of_the_softmax(vocab: int, kind: str) -> None:
    g = torch.Generator().manual_seed(vocab)
    rows = 32 if vocab == QWEN_VOCAB else 512
    logits = _logits(kind, rows, vocab, g)
    uniform = _uniforms(rows, g)
    pick, masses, lse = _plain(logits, uniform, temperature=0.7)
    assert pick.shape == (rows, 1) and pick.dtype == torch.long
    assert masses.shape == (rows, -(-vocab // CDF_BLOCK)) and masses.dtype == torch.float64
    assert torch.equal(pick, _one_scan_of_softmax(logits / 0.7, uniform))
    assert torch.allclose(lse, torch.logsumexp(logits, dim=-1))  # log-probs: unscaled


@pytest.mark.parametrize("vocab", [37, 3 * CDF_BLOCK + 123])
def test_banned_single_stops_are_never_picked_before_min_new_tokens(vocab: int) -> None:
    g = torch.Generator().manual_seed(7)
    rows = 256
    logits = _logits("usual", rows, vocab, g)
    single = torch.zeros(vocab, dtype=torch.bool)
    single[: vocab // 2] = True  # half the vocabulary: a pick would land there often
    logits[:, : vocab // 2] += 6.0
    uniform = _uniforms(rows, g)
    uniform[-1] = JUST_BELOW_ONE
    banned, _, _ = _plain(logits, uniform, single=single, step=1, min_new_tokens=2)
    assert (banned >= vocab // 2).all()
    reference = _one_scan_of_softmax(logits.masked_fill(single, float("-inf")), uniform)
    assert torch.equal(banned, reference)
    free, _, _ = _plain(logits, uniform, single=single, step=2, min_new_tokens=2)
    assert (free < vocab // 2).any()  # the ban ends at min_new_tokens
    assert torch.equal(free, _one_scan_of_softmax(logits, uniform))


def _sample(
    logits: torch.Tensor, uniform: torch.Tensor, params: SamplingParams, plain: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    sampler = Sampler(params, logits.shape[1], torch.device("cpu"))
    assert sampler.plain
    sampler.plain = plain  # the general path on the same structure: _prepare + _inverse_cdf
    return sampler.sample(logits, uniform, STEP_0)


@pytest.mark.parametrize("logprobs_use_temperature", [False, True])
def test_sampler_plain_path_gives_the_general_paths_tokens_and_log_probs(
    logprobs_use_temperature: bool,
) -> None:
    g = torch.Generator().manual_seed(3)
    vocab, rows = 5 * CDF_BLOCK + 17, 300  # more rows than SAMPLE_ROWS: blocks of rows
    logits = _logits("usual", rows, vocab, g).to(torch.bfloat16)
    uniform = _uniforms(rows, g)
    params = SamplingParams(
        max_new_tokens=4, temperature=0.8, stop_sequences=((5,), (6, 7)), min_new_tokens=1,
        logprobs_use_temperature=logprobs_use_temperature,
    )  # fmt: skip
    token, log_prob = _sample(logits, uniform, params, plain=True)
    general_token, general_log_prob = _sample(logits, uniform, params, plain=False)
    assert torch.equal(token, general_token)
    assert torch.equal(log_prob, general_log_prob)
    assert not (token == 5).any()  # banned at step 0 < min_new_tokens
    scale = 0.8 if logprobs_use_temperature else 1.0
    expected = torch.log_softmax(logits.float() / scale, dim=-1).gather(-1, token[:, None])
    assert torch.allclose(log_prob, expected.squeeze(1), atol=1e-5)


def test_structures_with_top_k_top_p_or_greedy_are_not_plain() -> None:
    vocab = 100
    for params, plain in (
        (SamplingParams(temperature=1.0), True),
        (SamplingParams(temperature=1.0, top_k=vocab), True),  # k >= V: no filter
        (SamplingParams(temperature=1.0, top_k=5), False),
        (SamplingParams(temperature=1.0, top_p=0.9), False),
        (SamplingParams(temperature=0.0), False),
    ):
        assert Sampler(params, vocab, torch.device("cpu")).plain is plain, params


def test_plain_path_compiles_with_fullgraph_and_picks_the_same() -> None:
    """No host synchronisation, no data-dependent Python: both passes trace with
    fullgraph (Inductor, on the CPU), over several blocks and a tail block."""
    g = torch.Generator().manual_seed(11)
    vocab, rows = 6 * CDF_BLOCK + 300, 24
    logits = _logits("usual", rows, vocab, g).to(torch.bfloat16)
    uniform = _uniforms(rows, g)
    single = torch.zeros(vocab, dtype=torch.bool)
    single[[3, vocab - 1]] = True
    args = (torch.tensor(0), torch.tensor(1.0), torch.tensor(1), single)
    torch._dynamo.reset()
    masses_fn = torch.compile(_plain_masses, fullgraph=True)
    pick_fn = torch.compile(_plain_pick, fullgraph=True)
    masses, top, lse = masses_fn(logits, *args, False)
    eager_masses, eager_top, eager_lse = _plain_masses(logits, *args, False)
    assert torch.allclose(masses, eager_masses, rtol=1e-5) and torch.equal(top, eager_top)
    assert torch.allclose(lse, eager_lse, atol=1e-5)
    step, temperature, min_new, _ = args
    pick = pick_fn(logits, masses, top, uniform, step, temperature, min_new, single)
    eager = _plain_pick(logits, eager_masses, eager_top, uniform, step, temperature, min_new,
                        single)  # fmt: skip
    assert torch.equal(pick, eager)
    assert not torch.isin(pick, torch.tensor([3, vocab - 1])).any()


def test_the_compiled_plain_path_samples_every_row_at_once() -> None:
    """Compiled, the plain path has no (rows, V) temporaries, so it samples all rows in one
    call (its reductions then fill the device); the others keep SAMPLE_ROWS blocks. A row's
    numbers do not depend on its block: any split gives the same tokens and log-probs."""
    vocab = 2 * CDF_BLOCK + 5
    plain, top_k = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=3)
    cpu = torch.device("cpu")
    assert Sampler(plain, vocab, cpu, compiled=True).rows_at_once >= 1 << 30
    assert Sampler(top_k, vocab, cpu, compiled=True).rows_at_once == SAMPLE_ROWS
    assert Sampler(plain, vocab, cpu).rows_at_once == SAMPLE_ROWS  # eager: bounded blocks
    g = torch.Generator().manual_seed(5)
    logits, uniform = _logits("usual", 40, vocab, g), _uniforms(40, g)
    sampler = Sampler(plain, vocab, cpu)
    whole = sampler.sample(logits, uniform, STEP_0)
    sampler.rows_at_once = 7  # blocks of 7 rows, the last one of 5
    split = sampler.sample(logits, uniform, STEP_0)
    assert torch.equal(whole[0], split[0]) and torch.equal(whole[1], split[1])
