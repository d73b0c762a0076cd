"""The sampler's two-level inverse CDF (server/generation/sampler._inverse_cdf) on the CPU.

It replaced one float64 scan over the whole vocabulary; that scan is kept here as the
reference: the two levels pick the same token (random rows, several vocabularies, peaked and
flat distributions, zeros, u near 0 and 1), never a probability-0 token (adversarial rows), do
it in temporaries far smaller than (rows, V) float64, and compile with fullgraph.
"""

from __future__ import annotations

import pytest
import torch
from rollserve.server.experience.generation import SamplingParams
from rollserve.server.generation.sampler import (
    CDF_BLOCK,
    MASS_CHUNK_BLOCKS,
    Sampler,
    _block_masses,
    _first_exceeding,
    _inverse_cdf,
    _prepare,
)
from torch.utils._python_dispatch import TorchDispatchMode

QWEN_VOCAB = 151936  # not a multiple of CDF_BLOCK
VOCABS = (QWEN_VOCAB, 4 * CDF_BLOCK, 3 * CDF_BLOCK + 123, CDF_BLOCK, CDF_BLOCK + 1, 37)
JUST_BELOW_ONE = 1.0 - 2.0**-53  # the largest float64 below 1


def _one_scan(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The former _inverse_cdf: one float64 CDF over the vocabulary, searchsorted."""
    cdf = probs.cumsum(-1, dtype=torch.float64)  # (r, n)
    pick = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)
    return pick.clamp_max(probs.shape[-1] - 1)


def _rows(kind: str, rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """(rows, vocab) float32 probabilities of one kind, as the sampler hands them over."""
    if kind == "peaked":
        return torch.softmax(torch.randn(rows, vocab, generator=g) * 8, dim=-1)
    if kind == "flat":
        return torch.softmax(torch.randn(rows, vocab, generator=g) * 0.1, dim=-1)
    if kind == "banned":  # min_new_tokens bans and top-k-like holes: zeros anywhere
        logits = torch.randn(rows, vocab, generator=g) * 3
        banned = torch.rand(rows, vocab, generator=g) < 0.5
        banned[:, 0] = False  # at least one token left
        return torch.softmax(logits.masked_fill(banned, float("-inf")), dim=-1)
    assert kind == "top_p"  # sorted descending, the tail filtered to 0, not renormalised
    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * 3, dim=-1).sort(-1, True)[0]
    mass_before = probs.cumsum(-1) - probs
    top_p = torch.rand(rows, 1, generator=g) * 0.98 + 0.01
    return probs.masked_fill(mass_before >= top_p, 0.0)


def _uniforms(rows: int, g: torch.Generator) -> torch.Tensor:
    """(rows,) float64: random, with u near 0 and near 1 among them."""
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    edges = torch.tensor([0.0, 1e-300, 1e-12, 1e-6, 1 - 1e-6, 1 - 1e-12], dtype=torch.float64)
    u[: len(edges)] = edges
    return u


@pytest.mark.parametrize("kind", ["peaked", "flat", "banned", "top_p"])
@pytest.mark.parametrize("vocab", VOCABS)
def test_two_level_pick_equals_the_one_float64_scan(vocab: int, kind: str) -> None:
    g = torch.Generator().manual_seed(vocab)
    rows = 48 if vocab == QWEN_VOCAB else 512
    probs = _rows(kind, rows, vocab, g)
    uniform = _uniforms(rows, g)
    pick = _inverse_cdf(probs, uniform)
    assert pick.shape == (rows, 1) and pick.dtype == torch.long
    assert torch.equal(pick, _one_scan(probs, uniform))
    assert (probs.gather(-1, pick) > 0).all()


def _adversarial(vocab: int) -> torch.Tensor:
    """Rows whose zeros sit where a pick that overshoots would land."""
    n = vocab
    g = torch.Generator().manual_seed(n)
    rows = []

    def row(positive: list[int]) -> None:
        r = torch.zeros(n)
        r[positive] = torch.rand(len(positive), generator=g) + 0.1
        rows.append(r / r.sum())

    row(list(range(n // 2)))  # the second half of the vocabulary is 0 (top-p)
    row([0])  # one token, first
    row([n - 1])  # one token, last
    row([n // 3])  # one token, inside a block
    row([min(CDF_BLOCK - 1, n - 1)])  # the last column of the first block
    last_block = n - (n % CDF_BLOCK or CDF_BLOCK)  # its first column
    row(list(range(max(last_block, 1))))  # the last block all zeros (one token if n < block)
    row(list(range(0, n, 7)))  # holes everywhere, ending in zeros
    row([0, n - 1])
    return torch.stack(rows)


@pytest.mark.parametrize("vocab", VOCABS)
def test_a_probability_0_token_is_never_picked(vocab: int) -> None:
    probs = _adversarial(vocab)
    positive = [row.nonzero().flatten() for row in probs]
    for u in (0.0, 1e-300, 0.5, 1 - 1e-9, 1 - 1e-15, JUST_BELOW_ONE):
        uniform = torch.full((probs.shape[0],), u, dtype=torch.float64)
        pick = _inverse_cdf(probs, uniform).squeeze(1)
        assert (probs.gather(-1, pick[:, None]) > 0).all(), u
        if u == 0.0:  # the first token of positive probability
            assert pick.tolist() == [int(p[0]) for p in positive]
        if u == JUST_BELOW_ONE:  # the limit u -> 1: the last token of positive probability
            assert pick.tolist() == [int(p[-1]) for p in positive]


def test_a_target_past_its_blocks_scan_picks_the_blocks_last_positive_token() -> None:
    """Float rounding between the levels: a block's mass, summed in lanes, keeps tiny
    probabilities that the scan inside the block (sequential, after a large one) rounds away,
    so u near 1 puts the target past the block's scan. The pick is then the block's last token
    of positive probability (the limit u -> 1), not a 0 after it, nor a column past V."""
    vocab, tiny = CDF_BLOCK + 100, 2.0**-55  # 0.5 + tiny rounds to 0.5
    probs = torch.zeros(2, vocab)
    probs[0, 0], probs[0, 1:1001] = 0.5, tiny  # then zeros to the end of the block
    probs[1, CDF_BLOCK], probs[1, CDF_BLOCK + 1 :] = 0.5, tiny  # the tail block, ending at V
    scans = (probs[0, :CDF_BLOCK], probs[1, CDF_BLOCK:])
    scan_ends = torch.stack([scan.double().cumsum(-1)[-1] for scan in scans])
    masses = _block_masses(probs).sum(-1)
    assert (masses > scan_ends).all(), "the setup needs sums in lanes"
    uniform = torch.full((2,), JUST_BELOW_ONE, dtype=torch.float64)
    assert _inverse_cdf(probs, uniform).squeeze(1).tolist() == [1000, vocab - 1]


def test_first_exceeding_skips_mass_0_columns_and_falls_back_to_the_last_positive() -> None:
    """The rule both levels share, on CDFs that rounding could produce: a target at or past
    the end (-> the last column of positive mass), and a scan that is not monotone (a GPU's
    parallel scan), where a mass-0 column's CDF comes out above the one before it."""
    mass = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0, 0.0, 0.0]])
    cdf = mass.double().cumsum(-1)
    past_end = torch.tensor([[1.0], [1.0 + 1e-12]], dtype=torch.float64)
    assert _first_exceeding(cdf, mass, past_end).tolist() == [3, 2]
    rounded_up = cdf.clone()
    rounded_up[0, 2] = 0.25 + 2.0**-50  # mass 0, yet above the target 0.25
    rounded_up[1, 1] = 0.5 + 2.0**-50
    target = torch.tensor([[0.25], [0.5]], dtype=torch.float64)
    assert _first_exceeding(rounded_up, mass, target).tolist() == [3, 2]
    assert _first_exceeding(cdf, mass, torch.zeros(2, 1, dtype=torch.float64)).tolist() == [1, 0]


class _CreatedBytes(TorchDispatchMode):
    """The largest tensor one op creates, in bytes, counting the float64 copy that ATen's sum
    and cumsum make of their whole input when asked for another dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        created = sum(
            t.nbytes
            for t in outs
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
        )  # views of an input create nothing
        dtype = kwargs.get("dtype")
        if func.overloadpacket in (torch.ops.aten.sum, torch.ops.aten.cumsum) and dtype:
            source = args[0]
            if dtype != source.dtype:
                created += source.numel() * torch.empty((), dtype=dtype).element_size()
        self.largest = max(self.largest, created)
        return out


@pytest.mark.parametrize("sampler", [_inverse_cdf, _one_scan], ids=["two_level", "one_scan"])
def test_temporaries_stay_far_below_a_float64_copy_of_the_rows(sampler) -> None:
    """The point of the two levels: the largest tensor is a chunk of MASS_CHUNK_BLOCKS blocks
    in float64, not (rows, V) in float64 (two of them for the one scan: its cast and its CDF)."""
    rows, vocab = 8, QWEN_VOCAB
    probs = torch.softmax(torch.randn(rows, vocab), dim=-1)
    uniform = torch.rand(rows, dtype=torch.float64)
    with _CreatedBytes() as created:
        sampler(probs, uniform)
    chunk = rows * MASS_CHUNK_BLOCKS * CDF_BLOCK * 8
    if sampler is _one_scan:  # the reference shows what the check catches
        assert created.largest >= rows * vocab * 8
    else:
        assert created.largest <= chunk < rows * vocab * 8 // 9


def test_compiled_with_fullgraph_gives_the_same_picks() -> None:
    """No host synchronisation, no data-dependent Python: torch.compile(fullgraph=True) traces
    it (Inductor, on the CPU), over two chunks of masses and a tail block."""
    vocab = 2 * MASS_CHUNK_BLOCKS * CDF_BLOCK + 300
    g = torch.Generator().manual_seed(1)
    probs = torch.cat([_rows("peaked", 16, vocab, g), _adversarial(vocab)])
    uniform = _uniforms(probs.shape[0], g)
    uniform[-8:] = JUST_BELOW_ONE
    torch._dynamo.reset()
    compiled = torch.compile(_inverse_cdf, fullgraph=True)
    assert torch.equal(compiled(probs, uniform), _inverse_cdf(probs, uniform))
    assert torch.equal(compiled(probs, uniform)[:16], _one_scan(probs[:16], uniform[:16]))


@pytest.mark.parametrize("compiled", [False, True])
def test_a_compiled_sampler_compiles_the_cdf_with_prepare(compiled: bool) -> None:
    """Eager, the two-level CDF is dozens of small kernels per block of rows: where the Sampler
    compiles _prepare (CUDA), it compiles _inverse_cdf too (construction only: no compile)."""
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    sampler = Sampler(params, 300, torch.device("cpu"), compiled=compiled)
    for got, fn in ((sampler._prepared, _prepare), (sampler._inverse_cdf, _inverse_cdf)):
        assert (getattr(got, "eager", None) is fn) if compiled else got is fn
