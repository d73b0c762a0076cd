"""A full-sequence forward's attention (prefill, scoring) as causal attention with no mask,
over rows laid out so that each one's real tokens come first.

Why: with an attention mask, SDPA runs a kernel that takes one (the efficient kernel on CUDA)
over every (query, key) pair of the mask, and the mask itself is (rows, queries, keys): made,
bounded by attention.MASK_BYTES and read in every layer. Causal with no mask, SDPA runs flash
attention, which skips the blocks above the diagonal (about half the work of a long row) and
needs no mask at all. On this project's CPU, one attention of 8 rows x 2,048 columns (14 heads,
head_dim 64, float32) took 1.22 s under one whole mask against 0.69 s causal, and the mask
another 0.16 s to make; a whole scoring request of such rows (masks in blocks of queries, the
suppression below, the gathers) ran 1.2-1.4x as fast (bench/bench_long_rows.py).

The layout: each row's columns rolled left by its count of leading pads, so a row is its real
tokens (one run: prompt and response), then its right pads, then its left pads. A real query
then sees, causally, exactly the real keys at or before it, as under the mask; every pad is
after it. A pad query is not so lucky: a right pad would also see the pads before it and
itself, where HF's mask (and attention.prefill_mask) shows it the real keys of its row only.
Scoring reads some right-pad queries (the critic under ColossalChat's layout reads values
past a row's end; the returned log-probs hold their columns), so where a row has right pads
the keys of pads are suppressed, exactly: q and k gain SUPPRESS_DIMS dimensions, q's first one
1, k's first one -suppress on a pad and 0 on a real token (v's zeros, so every input keeps one
head_dim, as flash requires), so a pad key scores -suppress x scale lower, far past where
exp underflows to 0 in float32, and a real key's score gains exactly 0. Its price: the copies
of q, k and v one dimension block wider, and on CUDA, whose flash kernels are built for a few
head_dims, 64 + 8 runs as 96 (the kernel's work x ~1.5 for head_dim 64 models; 128 + 8 as
160, x 1.25): still under the masked route's whole (query, key) grid. A left pad's query
sees the real keys of its row; its output is read by nothing (real queries never attend to
it, and the first real column of a row is never a scored state).

When (`causal_layout`): the forward's rows (or, with shared prompts, each group's prompt and
each row's rest) hold one run of real tokens each, at least one; no layer's sliding window is
shorter than the rows (the mask would cut what causal attention sees); the rows have at least
CAUSAL_MIN_COLUMNS columns (under them, the masked kernel was as fast on the CPU, and the
gathers here are extra copies); and with shared prompts, its attention work (every row's
prompt again, causal) is no more than the masked pair's (each prompt once, the rest against
it in full); where it is more, the prompts alone may still attend causally among themselves
(Forward._shared_attend), the rest under its mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import prefill_attention
from .switches import env_count

__all__ = [
    "CAUSAL_MIN_COLUMNS",
    "CAUSAL_MIN_COLUMNS_ENV",
    "SUPPRESS_DIMS",
    "CausalRows",
    "SharedPrompts",
    "causal_attention",
    "causal_layout",
    "causal_rows",
    "causal_work_fits",
    "row_runs",
]

# Rows shorter than this keep the masked attention. On this project's 2-core CPU (bench/
# RESULTS.md, session of 2026-11-28; `python bench/bench_long_rows.py`, masked / causal
# seconds of a scoring request, GRPO-shaped, 4 samples a prompt): 0.93 at 640 columns, 0.96 at
# 1,024, 1.19 at 2,048, 1.33 at 5,120 (own prompts: 1.39 at 2,560). Never measured on a GPU,
# where the masked route reads its mask in every layer and flash is the faster kernel: the
# crossover there is likely lower, and the bench shape (384 columns) stays masked.
CAUSAL_MIN_COLUMNS = 1536
# Sets the threshold instead (read at every forward): 0 takes the causal route wherever it may
# be taken, a number past any row's length never.
CAUSAL_MIN_COLUMNS_ENV = "ROLLSERVE_CAUSAL_MIN_COLUMNS"
# Extra head dimensions that carry the suppression of pad keys: one would do, 8 keep head_dim a
# multiple of 8, which flash kernels on CUDA require.
SUPPRESS_DIMS = 8
# How far below any real key a pad key scores (after the scale): exp(-1e4) is 0 in float32.
SUPPRESS_SCORE = 1e4


@dataclass(frozen=True)
class RowRuns:
    """What the choice of attention needs to know of a forward's valid (b, s) mask."""

    one_run: bool  # every row's real tokens are one run of columns, at least one a row
    right_pads: bool  # some row has a pad after its last real token


def row_runs(valid: torch.Tensor) -> RowRuns:
    """RowRuns of valid (b, s) bool; one synchronisation with the device."""
    s = valid.shape[1]
    columns = torch.arange(s, device=valid.device)
    first = valid.int().argmax(-1)  # (b,) 0 for a row without a real token
    count = valid.sum(-1)
    run = (columns[None] >= first[:, None]) & (columns[None] < (first + count)[:, None])
    one_run = (valid == run).all() & (count > 0).all()
    right_pads = (first + count < s).any()
    one, right = torch.stack([one_run, right_pads]).tolist()
    return RowRuns(bool(one), bool(right))


def causal_work_fits(rows: int, groups: int, width: int, columns: int) -> bool:
    """With shared prompts (each group's prompt of `width` columns run once), whether causal
    attention's work (every row's prompt again: rows x columns^2 / 2 pairs) is at most the
    masked pair's (each prompt against itself, every row's rest against all its columns)."""
    rest = columns - width
    return rows * columns * columns // 2 <= groups * width * width + rows * rest * columns


@dataclass(frozen=True)
class SharedPrompts:
    """A forward whose groups run their prompt (the first `width` columns) once: of_row (b,)
    each row's group, first (groups,) each group's first row (Forward._shared_prompts)."""

    width: int
    of_row: torch.Tensor
    first: torch.Tensor


def causal_layout(
    valid: torch.Tensor, windows: set[int | None], shared: SharedPrompts | None = None
) -> CausalRows | None:
    """CausalRows of a forward over rows valid (b, S) (causal_rows' arguments) when it should
    attend causally, for layers of these sliding windows; None for the masked attention: rows
    under CAUSAL_MIN_COLUMNS (ROLLSERVE_CAUSAL_MIN_COLUMNS when set) or under a window, shared
    prompts whose causal work would be larger (causal_work_fits), rows not one run of real
    tokens each. Synchronises with the device once, for the runs, only when the rest allows
    causal attention."""
    rows, columns = valid.shape
    if columns < env_count(CAUSAL_MIN_COLUMNS_ENV, CAUSAL_MIN_COLUMNS):
        return None
    if any(window is not None and window < columns for window in windows):
        return None
    if shared is not None:
        groups = int(shared.first.numel())
        if not causal_work_fits(rows, groups, shared.width, columns):
            return None
    runs = row_runs(valid)
    if not runs.one_run:
        return None
    return causal_rows(valid, runs.right_pads, shared)


@dataclass(frozen=True)
class CausalRows:
    """Where a forward's tokens (its token-major row: (T, ...)) sit in the rolled rows.

    to_rows (b, S): the token at each position of the rolled rows; token_row and
    token_column (T,): each token's position in them (a group's prompt tokens: in the group's
    first row); pads (T,) bool: which tokens are pads, where their keys must be suppressed
    (some row has right pads), else None."""

    to_rows: torch.Tensor
    token_row: torch.Tensor
    token_column: torch.Tensor
    pads: torch.Tensor | None


def causal_rows(
    valid: torch.Tensor, suppress: bool, shared: SharedPrompts | None = None
) -> CausalRows:
    """CausalRows of rows valid (b, S) whose real tokens are one run each (row_runs).

    Plain rows: the tokens are the rows' columns in order, row by row. Shared prompts: the
    tokens are each group's prompt columns, group by group, then every row's other columns,
    row by row (Forward._shared_prompts' row of tokens); a row's prompt positions read its
    group's tokens. suppress: record which tokens are pads."""
    b, s = valid.shape
    device = valid.device
    columns = torch.arange(s, device=device)
    rows = torch.arange(b, device=device)
    lead = valid.int().argmax(-1)  # (b,) leading pads
    width = 0 if shared is None else shared.width
    rest = s - width
    # token_of (b, S): the token at each row's original column.
    head_tokens = 0 if shared is None else int(shared.first.numel()) * width
    token_of = head_tokens + rows[:, None] * rest + (columns[None, width:] - width)
    # Each token's rolled position: a row's other columns in its own row, a prompt's column in
    # its group's first row.
    token_row = rows[:, None].expand(b, rest).reshape(-1)
    token_column = ((columns[None, width:] - lead[:, None]) % s).reshape(-1)
    pads = ~valid[:, width:].reshape(-1) if suppress else None
    if shared is not None:
        token_of = torch.cat([shared.of_row[:, None] * width + columns[None, :width], token_of], 1)
        first = shared.first
        head_columns = (columns[None, :width] - lead[first][:, None]) % s  # (groups, P)
        token_row = torch.cat([first[:, None].expand_as(head_columns).reshape(-1), token_row])
        token_column = torch.cat([head_columns.reshape(-1), token_column])
        if pads is not None:
            pads = torch.cat([~valid[first, :width].reshape(-1), pads])
    rolled = (columns[None] + lead[:, None]) % s  # rolled position -> original column
    return CausalRows(token_of.gather(1, rolled), token_row, token_column, pads)


def _suppressing(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pads: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (T, heads, D) with SUPPRESS_DIMS more dimensions: q's first 1, k's first
    -SUPPRESS_SCORE / scale on a pad token (0 elsewhere), the rest 0."""
    dim = q.shape[-1]
    q, k, v = (F.pad(t, (0, SUPPRESS_DIMS)) for t in (q, k, v))
    q[..., dim] = 1.0
    # Bounded in the dtype: float16's largest is 65,504 (a score still ~1,000 down at scale 1/8).
    suppress = min(SUPPRESS_SCORE / scale, torch.finfo(k.dtype).max / 8)
    k[..., dim] = torch.where(pads, -suppress, 0.0).to(k.dtype)[:, None]
    return q, k, v


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: CausalRows, scale: float
) -> torch.Tensor:
    """Token-major q (T, H, D), k and v (T, Hkv, D) -> the attention output (T, H, D): each
    token's queries against the keys of its row, by one causal SDPA over the rolled rows (the
    backends a surrounding prefill_backends allows)."""
    b, s = rows.to_rows.shape
    dim = q.shape[-1]
    if rows.pads is not None:
        q, k, v = _suppressing(q, k, v, rows.pads, scale)
    index = rows.to_rows.reshape(-1)

    def rolled(t: torch.Tensor) -> torch.Tensor:  # (T, h, D') -> (b, h, S, D')
        return t[index].view(b, s, *t.shape[1:]).transpose(1, 2)

    q_rows, k_rows, v_rows = rolled(q), rolled(k), rolled(v)
    del q, k, v  # the widened copies (the caller keeps its own): not alive through the attention
    out = prefill_attention(q_rows, k_rows, v_rows, None, scale)  # (b, H, S, D')
    by_position = out.transpose(1, 2)[..., :dim]  # (b, S, H, D)
    return by_position[rows.token_row, rows.token_column]  # (T, H, D)
