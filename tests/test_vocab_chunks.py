"""Scoring through lm_head in vocabulary chunks (server/experience/vocab_chunks.py): the online
log-sum-exp over chunks equals one log-softmax over the whole vocabulary, eager and compiled
(CUDA's default, forced onto the CPU here), with -inf logits, temperature and entropy; the plan
keeps a chunk within its bytes; action_log_probs through it equals the naive reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rollserve.server.experience import scoring, vocab_chunks
from rollserve.server.experience.scoring import action_log_probs
from rollserve.server.experience.vocab_chunks import (
    VOCAB_CHUNKS_ENV,
    vocab_chunked_log_probs,
    vocab_chunks_enabled,
    vocab_plan,
)
from test_scoring import actor, layout, naive_reference  # noqa: F401 - the fixture, too

HIDDEN, VOCAB = 16, 300
BANNED = 7  # a vocabulary id whose logit is -inf for every position (a bias of -inf)


def head_and_labels(dtype: torch.dtype, positions: int = 37, seed: int = 0):
    """Hidden states (positions, HIDDEN), lm_head weight (VOCAB, HIDDEN) and bias (-inf at
    BANNED), labels (positions,) with one at BANNED and some at chunk edges."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(positions, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) / 2).to(dtype)
    bias = torch.randn(VOCAB, generator=g).to(dtype)
    bias[BANNED] = float("-inf")
    labels = torch.randint(0, VOCAB, (positions,), generator=g)
    labels[:5] = torch.tensor([BANNED, 0, 127, 128, VOCAB - 1])
    return hidden, weight, bias, labels


def reference(hidden, weight, bias, labels, temperature, dtype):
    """One log-softmax over the whole vocabulary, in float32, of the model-dtype logits."""
    z = F.linear(hidden, weight, bias).float()
    if temperature is not None:
        z = z / temperature
    log_soft = torch.log_softmax(z, dim=-1)
    probs = log_soft.exp()
    entropy = -(probs * torch.where(probs > 0, log_soft, 0.0)).sum(-1)
    return log_soft.gather(-1, labels[:, None])[:, 0], entropy


def assert_matches(got, want, dtype: torch.dtype) -> None:
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite)
    torch.testing.assert_close(got[finite], want[finite], atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [None, 0.7])
@pytest.mark.parametrize("chunk_bytes", [1, 128 * 37 * 16 * 2, 1 << 30])  # 128 ids, 256, all
def test_chunks_equal_one_log_softmax_over_the_vocabulary(
    dtype: torch.dtype, temperature: float | None, chunk_bytes: int
) -> None:
    hidden, weight, bias, labels = head_and_labels(dtype)
    want_lp, want_ent = reference(hidden, weight, bias, labels, temperature, dtype)
    lp, ent = vocab_chunked_log_probs(
        hidden, weight, bias, labels, temperature, True, compiled=False, chunk_bytes=chunk_bytes
    )
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == labels.shape
    assert lp[0] == float("-inf")  # the banned label
    assert_matches(lp, want_lp, dtype)
    assert_matches(ent, want_ent, dtype)
    plain, none = vocab_chunked_log_probs(
        hidden, weight, None, labels, temperature, False, compiled=False, chunk_bytes=chunk_bytes
    )
    assert none is None
    assert_matches(plain, reference(hidden, weight, None, labels, temperature, dtype)[0], dtype)


def test_positions_go_in_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vocab_chunks, "PASS_POSITIONS", 5)  # 37 positions: 8 passes
    hidden, weight, bias, labels = head_and_labels(torch.float32)
    lp, ent = vocab_chunked_log_probs(
        hidden, weight, bias, labels, None, True, compiled=False, chunk_bytes=1
    )
    want_lp, want_ent = reference(hidden, weight, bias, labels, None, torch.float32)
    assert_matches(lp, want_lp, torch.float32)
    assert_matches(ent, want_ent, torch.float32)


def test_chunks_of_only_minus_infinity_before_the_first_finite_logit() -> None:
    # The running maximum starts at -inf and stays there through chunks whose logits are all
    # -inf: no inf - inf may turn into nan (as torch.logsumexp), and those chunks add nothing.
    hidden, weight, bias, labels = head_and_labels(torch.float32, positions=8)
    bias[:200] = float("-inf")  # the first chunks (128 ids each) are -inf for every position
    labels[:3] = torch.tensor([250, 10, 299])
    lp, ent = vocab_chunked_log_probs(
        hidden, weight, bias, labels, None, True, compiled=False, chunk_bytes=1
    )
    want_lp, want_ent = reference(hidden, weight, bias, labels, None, torch.float32)
    assert lp[1] == float("-inf") and lp[[0, 2]].isfinite().all() and ent.isfinite().all()
    assert_matches(lp, want_lp, torch.float32)
    assert_matches(ent, want_ent, torch.float32)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_the_compiled_step_equals_the_eager_one_and_stores_no_float32_chunk(
    with_entropy: bool,
) -> None:
    from torch._inductor.utils import run_and_get_code

    hidden, weight, bias, labels = head_and_labels(torch.bfloat16)
    eager = vocab_chunked_log_probs(
        hidden, weight, bias, labels, 0.7, with_entropy, compiled=False, chunk_bytes=1
    )
    compiled = vocab_chunked_log_probs(
        hidden, weight, bias, labels, 0.7, with_entropy, compiled=True, chunk_bytes=1
    )
    assert vocab_chunks._step(True).compiled is not None  # no eager fallback (graph break)
    for got, want in zip(compiled, eager, strict=True):
        if want is not None:
            assert_matches(got, want, torch.float32)
    # Inductor's code for one chunk: every buffer it allocates is per position, none (n, c).
    n, c = 37, 128
    logits = F.linear(hidden, weight[:c]).contiguous()
    state = [torch.zeros(n) for _ in range(4)]
    _, codes = run_and_get_code(
        torch.compile(vocab_chunks._online_step, fullgraph=True),
        logits, labels, *state, torch.tensor(0.7), with_entropy,
    )  # fmt: skip
    allocations = [line for code in codes for line in code.splitlines() if "empty_strided" in line]
    assert allocations and all(f"({n}, {c})" not in line for line in allocations), allocations


def test_the_plan_keeps_a_chunk_within_its_bytes() -> None:
    plan = vocab_plan(16384, 151936, 2, 128 << 20)  # the GPU bench's forward batch
    assert plan.positions == 16384 and plan.columns == 4096
    assert plan.positions * plan.columns * 2 <= 128 << 20
    small = vocab_plan(100, 32000, 2, 128 << 20)
    assert small.positions == 100 and small.columns == 32000  # the whole vocabulary fits
    assert vocab_plan(100, 32000, 2, 1).columns == 128  # at least one quantum
    assert vocab_plan(50_000, 32000, 2, 128 << 20).positions == 16384
    assert vocab_plan(1000, 32000, 2, 1000 * 2 * 1000).columns == 896  # a multiple of 128


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(VOCAB_CHUNKS_ENV, raising=False)
    assert vocab_chunks_enabled(cuda) and not vocab_chunks_enabled(cpu)
    monkeypatch.setenv(VOCAB_CHUNKS_ENV, "0")
    assert not vocab_chunks_enabled(cuda)
    monkeypatch.setenv(VOCAB_CHUNKS_ENV, "1")
    assert vocab_chunks_enabled(cpu)


@pytest.mark.parametrize("path", ["rollserve", "hf"])
@pytest.mark.parametrize("positions_per_chunk", [None, 1])
def test_action_log_probs_in_vocabulary_chunks_equal_the_naive_reference(
    actor,  # noqa: F811 - test_scoring's fixture
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    positions_per_chunk: int | None,
) -> None:
    # Both paths with a head: the engine's forward and the HF backbone with its lm_head; one
    # position per block asked for bounds the chunks to one quantum of ids (259 ids: 3 chunks).
    monkeypatch.setenv(VOCAB_CHUNKS_ENV, "1")
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return vocab_chunked_log_probs(*args, **kwargs)

    monkeypatch.setattr(scoring, "vocab_chunked_log_probs", spy)
    ids, mask, actions = layout()
    for temperature in (None, 0.7):
        want_lp, want_ent = naive_reference(actor, ids, mask, actions, temperature)
        lp, ent = action_log_probs(
            actor, ids, mask, actions, forward_batch_size=2, temperature=temperature,
            with_entropy=True, positions_per_chunk=positions_per_chunk, path=path,
        )  # fmt: skip
        torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=0)
    assert len(calls) == 2 * 3  # every forward batch took the chunks (5 rows, batches of 2)
    assert all(("chunk_bytes" in k) == (positions_per_chunk is not None) for k in calls)


def test_the_compiled_step_serves_every_size_with_one_graph() -> None:
    # Positions (rows x actions of a forward batch) and the last chunk's width vary from call to
    # call: each new size must not compile again (on the request path, after the warm-up).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    vocab_chunks._step.cache_clear()
    for positions in (37, 23, 50):
        hidden, weight, bias, labels = head_and_labels(torch.bfloat16, positions=positions)
        vocab_chunked_log_probs(hidden, weight, bias, labels, None, True, compiled=True,
                                chunk_bytes=positions * 2 * 128)  # fmt: skip
        if positions == 37:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.gpu
def test_on_cuda_the_chunks_are_the_default_and_equal_the_position_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Qwen2 (q/k/v biases, untied lm_head) in bfloat16 on the GPU: the default (compiled
    # vocabulary chunks) against the position blocks, engine path, with entropy.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=5000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    ids, mask, actions = layout()
    ids, mask = ids.cuda(), mask.cuda()
    monkeypatch.delenv(VOCAB_CHUNKS_ENV, raising=False)
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return vocab_chunked_log_probs(*args, **kwargs)

    monkeypatch.setattr(scoring, "vocab_chunked_log_probs", spy)

    def score(**extra):
        return action_log_probs(model, ids, mask, actions, forward_batch_size=2, with_entropy=True,
                                temperature=0.8, path="rollserve", **extra)  # fmt: skip

    # One position's float32 block asked for (20 kB): 14 positions a pass, chunks of 640 ids.
    chunks = score(positions_per_chunk=1)
    assert calls and all(call["compiled"] for call in calls)
    assert vocab_chunks._step(True).compiled is not None
    monkeypatch.setenv(VOCAB_CHUNKS_ENV, "0")
    blocks = score(positions_per_chunk=1)
    for got, want in zip(chunks, blocks, strict=True):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # bf16 logits of other GEMMs
