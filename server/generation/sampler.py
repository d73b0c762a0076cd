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
    scores = scaled
    if single is not None:
        banned = single[None] & (step < min_new_tokens)  # (1, V)
        scores = scores.masked_fill(banned, float("-inf"))
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


# Rows sampled at once. The float32 and float64 temporaries over the vocabulary (~16 bytes x
# vocab per row: the float cast, the probabilities, the float64 CDF) are the step's largest,
# and they live in the captured graphs' pool: ~310 MB for 128 rows of a 152k vocabulary, where
# a 512-row step sampled at once would hold ~1.2 GB. Blocks are static slices, so the step's
# shapes stay fixed; the extra launches are a few per block.
SAMPLE_ROWS = 128


def _row_blocks(rows: int, block: int) -> list[slice]:
    """Static slices of at most `block` rows (the shapes are fixed per batch bucket)."""
    return [slice(start, min(start + block, rows)) for start in range(0, rows, block)]


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index (r, 1) of each row's sample from its probabilities (r, n) and uniform (r,).

    Eager (a float64 scan over the vocabulary is where the compiler stumbles): float64 keeps
    the tail of a large vocabulary exact enough, and the first index whose CDF exceeds u is
    taken, so a probability-0 token never is.
    """
    cdf = probs.cumsum(-1, dtype=torch.float64)  # (r, n)
    pick = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)
    return pick.clamp_max(probs.shape[-1] - 1)


# One compiled _prepare per process (torch.compile keys its cache by function, not by Sampler):
# a new Sampler never compiles again, only a new shape or structure does.
_COMPILED_PREPARE: dict[bool, Callable[..., Any]] = {}


def _prepare_fn(compiled: bool) -> Callable[..., Any]:
    if compiled not in _COMPILED_PREPARE:
        _COMPILED_PREPARE[compiled] = maybe_compiled(_prepare, compiled)
    return _COMPILED_PREPARE[compiled]


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
        self._prepared = _prepare_fn(compiled)
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
        SAMPLE_ROWS rows at a time (each row's numbers do not depend on its block)."""
        if logits.shape[0] <= SAMPLE_ROWS:
            return self._sample_rows(logits, uniform, step)
        blocks = [
            self._sample_rows(logits[rows], uniform[rows], step)
            for rows in _row_blocks(logits.shape[0], SAMPLE_ROWS)
        ]
        return torch.cat([t for t, _ in blocks]), torch.cat([lp for _, lp in blocks])

    def _sample_rows(
        self, logits: torch.Tensor, uniform: torch.Tensor, step: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        first, ids, lse = self._prepared(
            logits, step, self.temperature, self.min_new_tokens, self.stops.single,
            self.greedy, self.top_k, self.filter_top_p, self.use_temperature,
        )  # fmt: skip
        if self.greedy:
            token = first
        else:
            probs = _top_p(first, self.top_p) if self.filter_top_p else first
            pick = _inverse_cdf(probs, uniform)  # (b, 1)
            token = pick.squeeze(1) if ids is None else ids.gather(-1, pick).squeeze(1)
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
