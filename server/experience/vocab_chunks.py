"""Action log-probs through lm_head in vocabulary chunks: one read of its weight per pass.

scoring.py's blocks run lm_head over a few hundred (row, column) positions at a time against
the whole vocabulary, so a forward batch reads lm_head's weight once per block: 38 reads of a
272 MB weight (10 GB) for one forward batch of the GPU bench's Qwen2-0.5B-shaped model (64 rows
x 256 actions, 152k vocabulary), in GEMMs of ~440 rows. On the H100 that part took 29 ms of a
100 ms forward batch for 4.5 TFLOP of matmuls (bench/RESULTS.md, 16:31 UTC 2026-11-26).

Here a pass takes up to PASS_POSITIONS positions at once and walks the vocabulary in chunks
of `columns` ids, keeping per position a running maximum, sum of exponentials (and, for the
entropy, of exponential x logit) rescaled as the maximum grows: the online log-sum-exp of
flash attention. The weight is read once per pass (once per forward batch at the bench's
16,384 positions), the GEMMs are (positions x chunk), and a chunk's logits (model dtype) are
the only large transient, of at most `chunk_bytes` (compiled) as the blocks were. The numbers
are those of scoring._block_log_probs up to float32 rounding (the sums run in another order).

On CUDA (scoring.FUSED_BLOCK_DEVICES) the step is compiled, which folds the cast, the
temperature and the exponentials into row reductions over the chunk (no float32 chunk is
stored); eager elsewhere, with `chunk_bytes` counting the float32 temporaries too.
ROLLSERVE_SCORING_VOCAB_CHUNKS=0 scores in position blocks as before, =1 in vocabulary chunks
on any device; unset, in vocabulary chunks on CUDA only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..generation import SCORING_CHUNK_BYTES
from ..generation.compiling import maybe_compiled
from ..generation.switches import cuda_switch

__all__ = [
    "PASS_POSITIONS",
    "VOCAB_CHUNKS_ENV",
    "VocabPlan",
    "vocab_chunked_log_probs",
    "vocab_chunks_enabled",
    "vocab_plan",
]

VOCAB_CHUNKS_ENV = "ROLLSERVE_SCORING_VOCAB_CHUNKS"
# Positions per pass: the weight is read once per pass and the positions' hidden states once per
# chunk, so (for a fixed chunk size in elements) the traffic is least when the two are about
# equal; 16,384 covers a forward batch of 64 rows x 256 actions in one pass.
PASS_POSITIONS = 16384
# The model-dtype logits of one chunk at most (compiled): half of the float32 block the KV
# budget reserves room for (kv_cache.activation_reserve_bytes), 128 MiB, what one lm_head block
# of scoring.py held on the H100 bench (441 positions x 152k vocabulary in bfloat16).
CHUNK_BYTES = SCORING_CHUNK_BYTES // 2
# Columns of a chunk are a multiple of this (GEMM tiles), unless the chunk is the whole vocabulary.
COLUMN_QUANTUM = 128
# Float32 temporaries per element of an eager step (the cast, the exponentials, their product).
EAGER_FLOAT32_TEMPORARIES = 3


def vocab_chunks_enabled(device: torch.device) -> bool:
    """Whether scoring on `device` takes the vocabulary chunks: ROLLSERVE_SCORING_VOCAB_CHUNKS
    "0" or "1" says so; unset, on CUDA (where the step compiles)."""
    return cuda_switch(VOCAB_CHUNKS_ENV, device)


@dataclass(frozen=True)
class VocabPlan:
    positions: int  # per pass
    columns: int  # vocabulary ids per chunk


def vocab_plan(
    positions: int, vocab: int, bytes_per_logit: int, chunk_bytes: int = CHUNK_BYTES
) -> VocabPlan:
    """Positions per pass and columns per chunk such that a chunk's transient (positions x
    columns x bytes_per_logit) stays within chunk_bytes: every position at once up to
    PASS_POSITIONS, then as many columns as fit, rounded down to COLUMN_QUANTUM (at least one
    quantum; the whole vocabulary when it fits)."""
    per_pass = max(1, min(positions, PASS_POSITIONS))
    fit = chunk_bytes // (per_pass * bytes_per_logit)
    if fit >= vocab:
        return VocabPlan(per_pass, vocab)
    return VocabPlan(per_pass, max(COLUMN_QUANTUM, fit // COLUMN_QUANTUM * COLUMN_QUANTUM))


def _online_step(
    logits: torch.Tensor,
    local_labels: torch.Tensor,
    top: torch.Tensor,
    total: torch.Tensor,
    weighted: torch.Tensor,
    picked: torch.Tensor,
    temperature: torch.Tensor,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk (n, c) of model-dtype logits into the running state of its n positions: the
    largest logit so far `top` (-inf before any), `total` = sum exp(z - top), `weighted` = sum
    exp(z - top) x z (entropy only), `picked` = the label's logit once its chunk came
    (local_labels: the labels minus the chunk's first id). z = logits / temperature, in
    float32. Pure (new tensors): compiled, it is a few row reductions over the chunk."""
    z = logits.float() / temperature
    new_top = torch.maximum(top, z.amax(-1))
    safe = torch.where(new_top.isinf(), 0.0, new_top)  # as torch.logsumexp: no inf - inf
    rescale = torch.exp(top - safe)  # 0 for a first chunk (top = -inf)
    exp = torch.exp(z - safe[:, None])
    total = total * rescale + exp.sum(-1)
    if with_entropy:
        # A token at -inf has probability 0 and adds 0 (not 0 x -inf = nan).
        finite = z.clamp_min(torch.finfo(z.dtype).min)
        weighted = weighted * rescale + (exp * finite).sum(-1)
    columns = logits.shape[1]
    inside = (local_labels >= 0) & (local_labels < columns)
    here = z.gather(-1, local_labels.clamp(0, columns - 1)[:, None])[:, 0]
    return new_top, total, weighted, torch.where(inside, here, picked)


@functools.cache
def _step(compiled: bool) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The online step, compiled once per process when asked (its cache is the function's),
    with dynamic shapes: a forward batch's positions (rows x actions) and the last chunk's
    width vary, and each new size would otherwise compile again, on the request path."""
    return maybe_compiled(_online_step, compiled, dynamic=True)


def vocab_chunked_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float | None,
    with_entropy: bool,
    *,
    compiled: bool,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) and entropy (n,) float32 of the positions' final hidden states (n, H) under
    lm_head (weight (V, H), bias (V,) or None), labels (n,) int64, the logits divided by
    `temperature` first (None: raw). No host synchronisation: on a GPU the passes and chunks
    queue back to back."""
    n, vocab = hidden.shape[0], weight.shape[0]
    per_logit = hidden.element_size() + (0 if compiled else 4 * EAGER_FLOAT32_TEMPORARIES)
    plan = vocab_plan(n, vocab, per_logit, chunk_bytes)
    step = _step(compiled)
    device = hidden.device
    # A 0-d tensor, not a Python float: dynamo would specialise on the value.
    divisor = torch.tensor(1.0 if temperature is None else temperature, device=device)
    log_probs = torch.empty(n, dtype=torch.float32, device=device)
    entropy = torch.empty_like(log_probs) if with_entropy else None
    for start in range(0, n, plan.positions):
        rows = slice(start, min(start + plan.positions, n))
        h, pass_labels = hidden[rows], labels[rows]
        size = h.shape[0]
        top = torch.full((size,), float("-inf"), dtype=torch.float32, device=device)
        total = torch.zeros(size, dtype=torch.float32, device=device)
        weighted, picked = torch.zeros_like(total), torch.zeros_like(total)
        for first in range(0, vocab, plan.columns):
            ids = slice(first, min(first + plan.columns, vocab))
            logits = F.linear(h, weight[ids], None if bias is None else bias[ids])
            top, total, weighted, picked = step(
                logits, pass_labels - first, top, total, weighted, picked, divisor, with_entropy
            )
            del logits
        log_norm = torch.where(top.isinf(), 0.0, top) + total.log()
        log_probs[rows] = picked - log_norm
        if entropy is not None:
            entropy[rows] = log_norm - weighted / total
    return log_probs, entropy
