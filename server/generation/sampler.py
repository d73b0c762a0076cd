"""Sampling on the device with static shapes: one call per step, no host synchronisation.

The semantics are those of server/experience/generation.py: temperature, then HF's order of
top-k and top-p; the min_new_tokens ban of single-token stop ids; log-probs over the UNFILTERED
distribution (divided by the temperature only under logprobs_use_temperature, never for greedy);
stop sequences matched on a rolling window of the last tokens, never reaching back into the
prompt and not counting before min_new_tokens. The step is a tensor, so the same call serves
every step (and a captured CUDA graph replays it). So are temperature, top-p and
min_new_tokens: a captured graph reads them, and only the settings that change the kernels
(sampler_structure) key the graphs. Random numbers come in as one uniform per row, drawn up
front (inverse-CDF sampling), so same seed -> same tokens.

Two paths of the same sampling: with top-k or top-p the candidates' float32 probabilities are
formed (_prepare) and inverted (_inverse_cdf); with every token a candidate (the plain
structure, what RL rollouts use) the inverse CDF runs over block masses computed straight from
the logits (_plain_masses, _plain_pick), and no (b, V) float32 tensor is written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .compiling import maybe_compiled

__all__ = ["SAMPLE_ROWS", "Sampler", "sampler_structure"]


@dataclass(frozen=True)
class _Stops:
    """Stop sequences grouped by length: (L, (n_L, L) ids) pairs."""

    groups: tuple[tuple[int, torch.Tensor], ...]
    width: int  # the rolling window's width: the longest stop sequence (at least 1)
    single: torch.Tensor | None  # (V,) bool: ids of single-token stops, None when there are none


def _stops(stop_sequences: tuple[tuple[int, ...], ...], vocab: int, device: torch.device) -> _Stops:
    by_length: dict[int, list[tuple[int, ...]]] = {}
    for seq in dict.fromkeys(stop_sequences):  # dedupe, keep order
        by_length.setdefault(len(seq), []).append(seq)
    groups = tuple(
        (length, torch.tensor(seqs, dtype=torch.long, device=device))
        for length, seqs in sorted(by_length.items())
    )
    single = None
    if 1 in by_length:
        single = torch.zeros(vocab, dtype=torch.bool, device=device)
        single[[s[0] for s in by_length[1]]] = True
    return _Stops(groups, max(by_length, default=1), single)


def sampler_structure(params: object, vocab: int) -> tuple:
    """What of the sampling settings shapes the step's kernels (and so keys its captured
    graphs): greedy or not, top-k's k, whether top-p filters, whether log-probs use the
    temperature, the stop sequences. The values of temperature, top-p and min_new_tokens are
    device tensors read by the step (Sampler.load), so requests that differ only in them
    share one workspace and its graphs."""
    temperature = float(params.temperature)
    return (
        temperature == 0.0,
        int(params.top_k) if 0 < params.top_k < vocab else 0,
        float(params.top_p) < 1.0,
        bool(params.logprobs_use_temperature) and temperature != 0.0,
        tuple(tuple(seq) for seq in params.stop_sequences),
    )


def _banned(
    scores: torch.Tensor,
    ids: torch.Tensor | None,
    step: torch.Tensor,
    min_new_tokens: torch.Tensor,
    single: torch.Tensor | None,
) -> torch.Tensor:
    """scores (b, n) with the single-token stops banned before min_new_tokens: -inf there. ids
    (b, n): the token ids of the columns (None: the columns are the vocabulary in order)."""
    if single is None:
        return scores
    stops = single[None] if ids is None else single[ids]
    return scores.masked_fill(stops & (step < min_new_tokens), float("-inf"))


def _prepare(
    logits: torch.Tensor,
    step: torch.Tensor,
    temperature: torch.Tensor,
    min_new_tokens: torch.Tensor,
    single: torch.Tensor | None,
    greedy: bool,
    top_k: int,
    filter_top_p: bool,
    use_temperature: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The element-wise part over (b, V): (greedy token (b,) or candidate probabilities
    (b, n), their token ids (None: n = V in id order), log-sum-exp of the log-prob
    distribution (b,)).

    Candidates follow HF's order: top-k, then top-p over the survivors' softmax (at least one
    token is kept); the min_new_tokens ban applies before both. A module-level function of
    tensors and structure flags, so one compiled code serves every Sampler.
    """
    raw = logits.float()
    scaled = raw if greedy else raw / temperature
    lse = torch.logsumexp(scaled if use_temperature else raw, dim=-1)
    scores = _banned(scaled, None, step, min_new_tokens, single)
    if greedy:
        return scores.argmax(dim=-1), None, lse
    ids = None
    values = scores
    if top_k:
        values, ids = torch.topk(scores, top_k, dim=-1)  # (b, k) descending
    elif filter_top_p:
        values, ids = torch.sort(scores, dim=-1, descending=True)  # (b, V)
    # With top-p the scan is left to _top_p (eager); these are the candidates' probabilities.
    return torch.softmax(values, dim=-1), ids, lse


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The candidates' probabilities (b, n), sorted descending, with top-p applied: a
    candidate survives while the mass before it is below top_p (index 0 always does). Not
    renormalised: _inverse_cdf scales its uniform by each row's total.

    Eager, outside the compiled _prepare: Inductor fails to generate code for this scan over
    a large vocabulary at some batch sizes (a float32 SplitScan, seen on an H100).
    """
    mass_before = torch.cumsum(probs, dim=-1) - probs
    return probs.masked_fill(mass_before >= top_p, 0.0)


# Rows sampled at once. The float32 temporaries over the vocabulary (~8 bytes x vocab per row:
# the float cast of the logits, the probabilities) are the step's largest, and they live in the
# captured graphs' pool: ~155 MB for 128 rows of a 152k vocabulary (_inverse_cdf adds ~17 MB),
# where a 512-row step sampled at once would hold ~0.6 GB. Not raised when _inverse_cdf lost
# its float64 (rows, vocab) tensors (8 more bytes x vocab per row, 16 at its peak): 256 rows
# would hold ~345 MB, more than the ~310 MB that 128 rows held before, and so give back all
# that the two-level CDF saves, for half the launches. Blocks are static slices, so the step's
# shapes stay fixed; the extra launches are a few dozen per block (mostly _inverse_cdf's).
SAMPLE_ROWS = 128
ROWS_UNBOUNDED = 1 << 62  # Sampler.rows_at_once where no temporary is (rows, V)
# Columns per block of the two-level inverse CDF: the float64 scan runs over one block per row
# (rows x CDF_BLOCK), after a float64 scan over the blocks' masses (rows x vocab / CDF_BLOCK).
CDF_BLOCK = 1024
# Blocks whose masses are summed per float64 cast: sum(dtype=float64) casts its whole input to
# float64 first, so a single sum over (rows, V) would hold a float64 copy of it (155 MB at 128
# rows of a 152k vocabulary). 16 blocks: a 16 MB copy at 128 rows, 10 casts for 152k columns.
MASS_CHUNK_BLOCKS = 16


def _row_blocks(rows: int, block: int) -> list[slice]:
    """Static slices of at most `block` rows (the shapes are fixed per batch bucket)."""
    return [slice(start, min(start + block, rows)) for start in range(0, rows, block)]


def _block_masses(probs: torch.Tensor) -> torch.Tensor:
    """Float64 masses (r, nb) of probs' (r, n) blocks of CDF_BLOCK columns; when n is not a
    multiple of CDF_BLOCK, the last block is the n % CDF_BLOCK tail (no padded copy)."""
    rows, n = probs.shape
    full = n // CDF_BLOCK
    blocks = probs[:, : full * CDF_BLOCK].reshape(rows, full, CDF_BLOCK)  # a view
    # One float64 chunk, reused: the casts fill it in turn (fewer fresh pages on the CPU).
    cast = probs.new_empty((rows, min(full, MASS_CHUNK_BLOCKS), CDF_BLOCK), dtype=torch.float64)
    masses = []
    for start in range(0, full, MASS_CHUNK_BLOCKS):
        chunk = blocks[:, start : start + MASS_CHUNK_BLOCKS]  # (r, <= MASS_CHUNK_BLOCKS, block)
        masses.append(cast[:, : chunk.shape[1]].copy_(chunk).sum(-1))
    if n % CDF_BLOCK:
        masses.append(probs[:, full * CDF_BLOCK :].to(torch.float64).sum(-1, keepdim=True))
    return torch.cat(masses, dim=-1)


def _first_exceeding(cdf: torch.Tensor, mass: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Index (r,) of the first column whose cdf (r, m) exceeds target (r, 1) among those of
    positive mass (r, m); the last column of positive mass when none does (rounding can put
    the target at or past the end); 0 when no column has mass.

    What searchsorted(cdf, target, right=True) gives on a sorted CDF, where a mass-0 column
    never wins (its CDF equals the one before it), but also on a scan whose rounding is not
    monotone (a GPU's parallel scan) and past the end: the mask makes it so, not the CDF.
    """
    width = cdf.shape[-1]
    columns = torch.arange(width, device=cdf.device)  # (m,)
    positive = mass > 0
    first = torch.where(positive & (cdf > target), columns, width).amin(-1)
    last = torch.where(positive, columns, -1).amax(-1)
    return torch.where(first < width, first, last).clamp_min(0)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index (r, 1) of each row's sample from its probabilities (r, n) and uniform (r,): the
    first index whose CDF exceeds u x the row's total, so a probability-0 token never is.

    Two levels, in float64 (exact enough for the tail of a large vocabulary): the block of
    CDF_BLOCK columns where the row's CDF crosses the target, from the blocks' masses; then the
    token inside it, from the block's CDF offset by the mass before it. The same pick as one
    float64 scan over the vocabulary up to rounding (~1e-16 of the mass), whose temporaries were
    two float64 (r, n) tensors (the cast and the CDF); here the largest is the float64 chunk of
    MASS_CHUNK_BLOCKS blocks, then (r, CDF_BLOCK) ones. Static shapes, no host synchronisation,
    no data-dependent Python: a captured graph replays it, and it compiles with fullgraph (the
    Sampler compiles it where it compiles _prepare: on CUDA).
    """
    n = probs.shape[1]
    block, target, before = _choose_block(_block_masses(probs), uniform)
    columns = _block_columns(block, n)
    # Columns past n (the tail block) count as probability 0.
    inside = probs.gather(-1, columns.clamp_max(n - 1)).masked_fill(columns >= n, 0.0)
    return _pick_in_block(block, inside, before, target)


def _choose_block(
    masses: torch.Tensor, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first level of the inverse CDF: from the blocks' masses (r, nb) (any scale) and the
    uniforms (r,), the block (r, 1) where each row's CDF crosses its target, the target (r, 1)
    (u x the row's total) and the mass before that block (r, 1), in float64."""
    masses = masses.to(torch.float64)
    cdf = torch.cat([masses.new_zeros(masses.shape[0], 1), masses.cumsum(-1)], dim=-1)
    target = uniform[:, None].to(torch.float64) * cdf[:, -1:]  # (r, 1)
    block = _first_exceeding(cdf[:, 1:], masses, target)[:, None]  # (r, 1)
    return block, target, cdf.gather(-1, block)


def _block_columns(block: torch.Tensor, n: int) -> torch.Tensor:
    """Column ids (r, min(CDF_BLOCK, n)) of each row's block (r, 1); the tail block's run past
    n - 1 (the caller treats those as probability 0)."""
    return block * CDF_BLOCK + torch.arange(min(CDF_BLOCK, n), device=block.device)


def _pick_in_block(
    block: torch.Tensor, inside: torch.Tensor, before: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """The second level: the index (r, 1) of the column of the chosen block whose CDF (the
    mass before the block plus a float64 scan of its masses inside (r, width), on the scale
    of _choose_block's masses) first exceeds the target."""
    inside_cdf = before + inside.to(torch.float64).cumsum(-1)  # (r, width)
    return block * CDF_BLOCK + _first_exceeding(inside_cdf, inside, target)[:, None]


def _block_sums(weights: torch.Tensor) -> torch.Tensor:
    """Float64 sums (r, nb) of weights' (r, n) CDF_BLOCK-column blocks (the tail block last).

    Traced by torch.compile: one reduction per part that casts as it reads (Inductor fuses the
    weights' arithmetic into it, so they are never written). Eager: _block_masses, whose
    float64 casts are chunked (ATen's sum(dtype=float64) casts its whole input first)."""
    if not torch.compiler.is_compiling():
        return _block_masses(weights)
    rows, n = weights.shape
    blocks = -(-n // CDF_BLOCK)
    # Padded with zeros to whole blocks: one reduction is the weights' only reader (a second
    # one over the tail would make Inductor write them out for both).
    padded = torch.nn.functional.pad(weights, (0, blocks * CDF_BLOCK - n))
    return padded.view(rows, blocks, CDF_BLOCK).sum(-1, dtype=torch.float64)


def _plain_masses(
    logits: torch.Tensor,
    step: torch.Tensor,
    temperature: torch.Tensor,
    min_new_tokens: torch.Tensor,
    single: torch.Tensor | None,
    use_temperature: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain structure (no top-k, no top-p: every token is a candidate, the RL default),
    first pass: the float64 masses (b, nb) of the CDF blocks of exp(score - top), top (b, 1)
    the row's largest score, and the log-sum-exp (b,) of the log-prob distribution, where
    score = logits / temperature with the min_new_tokens ban (as _prepare's).

    Nothing of (b, V) is kept: compiled, these are reductions over the model-dtype logits,
    where _prepare + _inverse_cdf write float32 probabilities and read them back several
    times (on an H100, 0.94 ms of a 4.5 ms decode step at 512 rows of a 152k vocabulary; a
    read of the bf16 logits takes ~0.05 ms). The weights exp(score - top) are float32, as
    _prepare's probabilities; their sums are float64, so the pick is one float64 scan's over
    those weights (a float32 sum of a block would move a CDF boundary by ~1e-7 of its mass).
    """
    raw = logits.float()
    scaled = raw / temperature
    lse = torch.logsumexp(scaled if use_temperature else raw, dim=-1)
    scores = _banned(scaled, None, step, min_new_tokens, single)
    top = scores.amax(-1, keepdim=True)
    return _block_sums(torch.exp(scores - top)), top, lse


def _plain_pick(
    logits: torch.Tensor,
    masses: torch.Tensor,
    top: torch.Tensor,
    uniform: torch.Tensor,
    step: torch.Tensor,
    temperature: torch.Tensor,
    min_new_tokens: torch.Tensor,
    single: torch.Tensor | None,
) -> torch.Tensor:
    """The plain structure, second pass: the index (b, 1) of each row's sample, the inverse
    CDF of _inverse_cdf over _plain_masses' blocks, the chosen block's weights recomputed
    from its CDF_BLOCK logits by the same arithmetic (exp(score - top))."""
    n = logits.shape[1]
    block, target, before = _choose_block(masses, uniform)
    columns = _block_columns(block, n)
    ids = columns.clamp_max(n - 1)
    scores = _banned(logits.gather(-1, ids).float() / temperature, ids, step, min_new_tokens,
                     single)  # fmt: skip
    inside = torch.exp(scores - top).masked_fill(columns >= n, 0.0)
    return _pick_in_block(block, inside, before, target)


# One compiled _prepare and _inverse_cdf per process (torch.compile keys its cache by function,
# not by Sampler): a new Sampler never compiles again, only a new shape or structure does.
_COMPILED: dict[tuple[Callable[..., Any], bool], Callable[..., Any]] = {}


def _compiled_fn(fn: Callable[..., Any], compiled: bool) -> Callable[..., Any]:
    if (fn, compiled) not in _COMPILED:
        _COMPILED[fn, compiled] = maybe_compiled(fn, compiled)
    return _COMPILED[fn, compiled]


class Sampler:
    """The sampling of one structure (sampler_structure), as tensors on the device; the
    values of a request are loaded into them in place (load), so captured graphs stay valid."""

    def __init__(
        self, params: object, vocab: int, device: torch.device, *, compiled: bool = False
    ) -> None:
        self.structure = sampler_structure(params, vocab)
        self.greedy, self.top_k, self.filter_top_p, self.use_temperature, stops = self.structure
        self.stops = _stops(stops, vocab, device)
        self.temperature = torch.ones((), dtype=torch.float32, device=device)
        self.top_p = torch.ones((), dtype=torch.float32, device=device)
        self.min_new_tokens = torch.zeros((), dtype=torch.long, device=device)
        # Compiled (CUDA): the float cast, softmax and log-sum-exp over (b, V) fuse into a
        # few passes over the logits instead of one pass per operation.
        self._prepared = _compiled_fn(_prepare, compiled)
        # Compiled too: eager, the two-level CDF is ~60 small kernels per block of rows (its
        # float64 casts are chunked to bound memory); Inductor folds the casts into the sums.
        self._inverse_cdf = _compiled_fn(_inverse_cdf, compiled)
        # Every token a candidate (no top-k, no top-p): sampled from block masses, no (b, V)
        # probabilities (_plain_masses).
        self.plain = not self.greedy and not self.top_k and not self.filter_top_p
        self._plain_masses = _compiled_fn(_plain_masses, compiled)
        self._plain_pick = _compiled_fn(_plain_pick, compiled)
        # Rows sampled per call: SAMPLE_ROWS bounds the (rows, V) float32 temporaries, which
        # the compiled plain path does not have; there all rows go at once, since its
        # reductions over the vocabulary run a program per row (128 rows on an H100's 132 SMs
        # read the logits at ~1.1 TB/s: 0.43 ms of a 3.7 ms step at 512 rows in blocks).
        self.rows_at_once = ROWS_UNBOUNDED if self.plain and compiled else SAMPLE_ROWS
        self.load(params)

    def load(self, params: object) -> None:
        """Take a request's temperature, top-p and min_new_tokens (same structure), in place
        (device fills: no host synchronisation)."""
        self.temperature.fill_(float(params.temperature) if not self.greedy else 1.0)
        self.top_p.fill_(float(params.top_p))
        self.min_new_tokens.fill_(int(params.min_new_tokens))

    @property
    def window(self) -> int:
        return self.stops.width

    def sample(
        self, logits: torch.Tensor, uniform: torch.Tensor, step: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token (b,) int64 and its log-prob (b,) float32 from logits (b, V) at `step` (0-d),
        rows_at_once rows at a time (each row's numbers do not depend on its block)."""
        if logits.shape[0] <= self.rows_at_once:
            return self._sample_rows(logits, uniform, step)
        blocks = [
            self._sample_rows(logits[rows], uniform[rows], step)
            for rows in _row_blocks(logits.shape[0], self.rows_at_once)
        ]
        return torch.cat([t for t, _ in blocks]), torch.cat([lp for _, lp in blocks])

    def _sample_rows(
        self, logits: torch.Tensor, uniform: torch.Tensor, step: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        single = self.stops.single
        if self.plain:
            masses, top, lse = self._plain_masses(
                logits, step, self.temperature, self.min_new_tokens, single, self.use_temperature
            )
            pick = self._plain_pick(logits, masses, top, uniform, step, self.temperature,
                                    self.min_new_tokens, single)  # fmt: skip
            return self._chosen(logits, pick.squeeze(1), lse)
        first, ids, lse = self._prepared(
            logits, step, self.temperature, self.min_new_tokens, single,
            self.greedy, self.top_k, self.filter_top_p, self.use_temperature,
        )  # fmt: skip
        if self.greedy:
            token = first
        else:
            probs = _top_p(first, self.top_p) if self.filter_top_p else first
            pick = self._inverse_cdf(probs, uniform)  # (b, 1)
            token = pick.squeeze(1) if ids is None else ids.gather(-1, pick).squeeze(1)
        return self._chosen(logits, token, lse)

    def _chosen(
        self, logits: torch.Tensor, token: torch.Tensor, lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The token (b,) and its log-prob: its logit (over the temperature under
        logprobs_use_temperature) minus the log-sum-exp of that distribution."""
        chosen = logits.gather(-1, token[:, None]).squeeze(1).float()
        if self.use_temperature:
            chosen = chosen / self.temperature
        return token, chosen - lse

    def stop_hits(self, window: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """Rows (b,) whose window (b, W), ending with the token of `step`, ends a stop sequence
        that lies inside the response (step + 1 tokens generated) and counts (step >=
        min_new_tokens)."""
        hit = torch.zeros(window.shape[0], dtype=torch.bool, device=window.device)
        for length, seqs in self.stops.groups:
            tail = window[:, -length:]  # (b, L)
            match = (tail[:, None, :] == seqs[None, :, :]).all(-1).any(-1)
            hit = hit | (match & (step + 1 >= length))
        return hit & (step >= self.min_new_tokens)
