"""Decode attention that reads a GRPO group's prompt once per group, not once per sample.

A rollout of n samples per prompt decodes n rows whose first P cache columns hold the same
prompt K/V (prefill copies a group's prompt to each of its rows). Plain decode attention reads
every row's columns, so each prompt column is read n times per step: in the issue's case (64
prompts x 8, 128 + 256 tokens) the prompt is a third to a half of the K/V a step reads. Here
the columns split at `prefix` (<= P): columns [0, prefix) are attended by all the queries of a
group at once against its first row's K/V (one read per group, the n x G query heads of a KV
head as one (n G, D) block), columns [prefix, w) per row as before, and the two parts merge
by their log-sum-exps (the "cascade" of FlashInfer, Hydragen's prefix attention):

    out = (o_prefix x e^(lse_prefix - m) + o_rest x e^(lse_rest - m)) / (e^(... - m) + e^(... - m))

Exact: the same softmax over the same columns, only the reads of the shared ones are shared.
The K/V bytes a step reads fall from b x w columns to b/n x prefix + b x (w - prefix): in the
issue's case 39 % fewer on average over its steps (1.81 -> 1.10 GB per step of the bench
model), and the longer the prompt next to the response, the more (a 1024-token prompt, 256
tokens, n = 8: 3.8x fewer).

Preconditions (the caller's layout, not checked here): rows come in groups of `samples`
consecutive rows (b a multiple of it) whose columns [0, prefix) hold the same K/V and the same
mask (a group's prompt, left-padded alike). Two implementations of the same math; the engine
runs one (SHARED_PREFIX_ATTENTION_ENV names it, off by default until a GPU has timed them) on
a batch whose rows are such groups (runner.py: GRPO requests, until the first rows finish and
leave the batch), and bench/profile_gpu.py times both against the plain variants on the
request's own cache.

  "matmul_shared"  the scores by batched matmuls (as attention.decode_attention_matmul, HF's
                   eager numerics: scores in the model dtype, softmax in float32); compiles
                   whole (fullgraph) on any device;
  "flex_shared"    two flex_attention calls that return their log-sum-exps, merged; compiled
                   on CUDA only (Inductor's CPU flex kernel has no log-sum-exp in torch 2.13),
                   eager (the unfused reference) elsewhere.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from .attention import DecodeAttention
from .compiling import maybe_compiled

__all__ = [
    "SHARED_PREFIX_ATTENTION",
    "SHARED_PREFIX_ATTENTION_ENV",
    "SHARED_PREFIX_QUANTUM",
    "SharedPrefix",
    "shared_prefix_attention",
    "shared_prefix_attention_flex",
    "shared_prefix_attention_matmul",
    "shared_prefix_from_env",
    "shared_prefix_variants",
]

# The shared columns are the prompt's rounded down to this many: a static split that keeps both
# parts' widths multiples of the engine's attention quantum (runner.ATTENTION_QUANTUM), so the
# suffix's views stay as aligned as the plain step's.
SHARED_PREFIX_QUANTUM = 64


@dataclass(frozen=True)
class SharedPrefix:
    """Groups of `samples` consecutive rows sharing cache columns [0, prefix)."""

    samples: int
    prefix: int

    @classmethod
    def of_layout(cls, samples: int, prompt_width: int) -> SharedPrefix | None:
        """The split for groups of `samples` rows whose prompts fill prompt_width columns:
        the prompt rounded down to SHARED_PREFIX_QUANTUM; None where nothing is shared (one
        sample per prompt, or a prompt narrower than the quantum)."""
        prefix = prompt_width // SHARED_PREFIX_QUANTUM * SHARED_PREFIX_QUANTUM
        return cls(samples, prefix) if samples >= 2 and prefix > 0 else None

    def columns_read(self, rows: int, width: int) -> int:
        """Cache columns (per KV head and layer, K or V) a step of `rows` rows x `width`
        columns reads: the shared ones once per group, the rest per row."""
        return rows // self.samples * self.prefix + rows * (width - self.prefix)


def _by_group(x: torch.Tensor, samples: int) -> torch.Tensor:
    """(b, Hkv, G, ...) per row -> (b / samples, Hkv, samples x G, ...): a group's rows become
    one block of query positions per KV head."""
    b, kv_heads, group = x.shape[:3]
    rest = x.shape[3:]
    grouped = x.reshape(b // samples, samples, kv_heads, group, *rest).transpose(1, 2)
    return grouped.reshape(b // samples, kv_heads, samples * group, *rest)


def _by_row(x: torch.Tensor, samples: int, group: int) -> torch.Tensor:
    """_by_group's inverse: (b / samples, Hkv, samples x G, ...) -> (b, Hkv, G, ...)."""
    groups, kv_heads = x.shape[:2]
    rest = x.shape[3:]
    rows = x.reshape(groups, kv_heads, samples, group, *rest).transpose(1, 2)
    return rows.reshape(groups * samples, kv_heads, group, *rest)


def _merge(
    parts: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Two attentions' outputs (b, Hkv, G, D) over disjoint columns, each normalised over its
    own columns, with their log-sum-exps (b, Hkv, G) float32 -> the attention over both. A part
    with no allowed column (lse -inf) weighs 0; the float32 sum is rounded once."""
    (first, first_lse), (second, second_lse) = parts
    top = torch.maximum(first_lse, second_lse)
    top = torch.where(top.isinf(), 0.0, top)  # no -inf - -inf
    first_weight = torch.exp(first_lse - top)[..., None]
    second_weight = torch.exp(second_lse - top)[..., None]
    merged = first.float() * first_weight + second.float() * second_weight
    return (merged / (first_weight + second_weight)).to(dtype)


def _matmul_part(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention (b, Hkv, Q, D) of q (b, Hkv, Q, D) over k/v (b, Hkv, w, D) with the additive
    mask (b, w), and its log-sum-exp (b, Hkv, Q) float32: scores in the model dtype, softmax
    in float32, probabilities cast back (decode_attention_matmul's numerics)."""
    scores = torch.matmul(q, k.transpose(2, 3)) * scale + mask[:, None, None]
    top = scores.float().amax(-1, keepdim=True)
    top = torch.where(top.isinf(), 0.0, top)
    weights = torch.exp(scores.float() - top)
    total = weights.sum(-1, keepdim=True)
    # No allowed column (a group's shared columns all left pads): weights and output 0, lse
    # -inf, so the merge weighs it 0 (0 / 0 would be nan, and nan x 0 is nan).
    probs = (weights / total.clamp_min(torch.finfo(torch.float32).tiny)).to(q.dtype)
    return torch.matmul(probs, v), (total.log() + top)[..., 0]


def _shared_matmul(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    samples: int,
    prefix: int,
) -> torch.Tensor:
    b, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    grouped = q.view(b, kv_heads, group, dim)
    shared = _matmul_part(
        _by_group(grouped, samples), k[::samples, :, :prefix], v[::samples, :, :prefix],
        mask[::samples, :prefix], scale,
    )  # fmt: skip
    own = _matmul_part(grouped, k[:, :, prefix:], v[:, :, prefix:], mask[:, prefix:], scale)
    first = (_by_row(shared[0], samples, group), _by_row(shared[1], samples, group))
    return _merge((first, own), q.dtype).reshape(b, heads, dim)


@functools.cache
def _matmul_compiled() -> Callable[..., torch.Tensor]:
    """The compiled _shared_matmul (one per process; fullgraph; torch's default for shapes:
    static first, symbolic after a recompile)."""
    return maybe_compiled(_shared_matmul, True)


def shared_prefix_attention_matmul(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    *,
    samples: int,
    prefix: int,
    compiled: bool = False,
) -> torch.Tensor:
    """decode_attention's contract (q (b, H, D), k/v (b, Hkv, w, D) cache views, additive mask
    (b, w) -> (b, H, D)) for groups of `samples` rows sharing columns [0, prefix), by matmuls;
    `compiled`: the one compiled code for every shape."""
    if not compiled:
        return _shared_matmul(q, k, v, mask, scale, samples, prefix)
    _widths_dynamic(k, v, mask)
    return _matmul_compiled()(q, k, v, mask, scale, samples, prefix)


def _widths_dynamic(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> None:
    """The width varies from step to step: symbolic in the compiled code from its first
    compile, not a recompile per width (as attention.decode_attention_flex marks it)."""
    if not torch.compiler.is_compiling():  # marks are for dynamo's entry, not inside a trace
        for tensor, width_dim in ((k, 2), (v, 2), (mask, 1)):
            torch._dynamo.maybe_mark_dynamic(tensor, width_dim)


def _flex_part(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """flex_attention of q (b, Hkv, Q, D) over k/v with the additive mask (b, w) as a score_mod
    (as attention._flex_grouped), with its log-sum-exp (b, Hkv, Q) float32."""

    def add_mask(
        score: torch.Tensor, row: torch.Tensor, head: torch.Tensor, query: torch.Tensor,
        column: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        return score + mask[row, column]

    out, aux = flex_attention(
        q, k, v, score_mod=add_mask, scale=scale, return_aux=AuxRequest(lse=True)
    )
    return out, aux.lse


def _shared_flex(
    by_group: torch.Tensor,
    grouped: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    samples: int,
    prefix: int,
) -> torch.Tensor:
    group = grouped.shape[2]
    shared_out, shared_lse = _flex_part(
        by_group, k[::samples, :, :prefix], v[::samples, :, :prefix], mask[::samples, :prefix],
        scale,
    )  # fmt: skip
    own = _flex_part(grouped, k[:, :, prefix:], v[:, :, prefix:], mask[:, prefix:], scale)
    first = (_by_row(shared_out, samples, group), _by_row(shared_lse, samples, group))
    return _merge((first, own), grouped.dtype)


@functools.cache
def _flex_compiled() -> Callable[..., torch.Tensor]:
    """The compiled _shared_flex (one per process; fullgraph, static shapes as attention's
    flex variant: Inductor's decoding kernel wants them)."""
    return maybe_compiled(_shared_flex, True, dynamic=False)


def shared_prefix_attention_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    *,
    samples: int,
    prefix: int,
    compiled: bool = False,
) -> torch.Tensor:
    """shared_prefix_attention_matmul's contract by two flex_attention calls; `compiled`: on
    CUDA only (Inductor's CPU flex kernel returns no log-sum-exp), else flex's eager reference.
    The query blocks are made here, outside the compiled graph (as attention's flex variant:
    its template reads the shape of the buffer under a view made inside it)."""
    b, heads, dim = q.shape
    grouped = q.view(b, k.shape[1], heads // k.shape[1], dim)
    by_group = _by_group(grouped, samples).contiguous()
    fn = _shared_flex
    if compiled and q.is_cuda:  # the CPU kernel returns no log-sum-exp
        _widths_dynamic(k, v, mask)
        fn = _flex_compiled()
    out = fn(by_group, grouped, k, v, mask, scale, samples, prefix)
    return out.reshape(b, heads, dim)


def shared_prefix_variants(
    shared: SharedPrefix, device: torch.device, compiled: bool
) -> dict[str, DecodeAttention]:
    """The shared-prefix variants for this split, in DecodeAttention's signature (for
    attention.pick_decode_attention): "matmul_shared" always, "flex_shared" where `compiled`
    and on CUDA (eager flex materialises every score: a reference, not a candidate)."""
    names = ["matmul_shared"] + (["flex_shared"] if compiled and device.type == "cuda" else [])
    return {name: shared_prefix_attention(name, shared, compiled) for name in names}


# What ROLLSERVE_SHARED_PREFIX_ATTENTION may name: the engine's attention for grouped batches.
SHARED_PREFIX_ATTENTION: dict[str, Callable[..., torch.Tensor]] = {
    "matmul_shared": shared_prefix_attention_matmul,
    "flex_shared": shared_prefix_attention_flex,
}
SHARED_PREFIX_ATTENTION_ENV = "ROLLSERVE_SHARED_PREFIX_ATTENTION"


def shared_prefix_from_env() -> str | None:
    """The shared-prefix variant ROLLSERVE_SHARED_PREFIX_ATTENTION names (None: unset, empty or
    "off", the default: every batch runs the plain decode attention); ValueError for a name not
    in SHARED_PREFIX_ATTENTION."""
    name = os.environ.get(SHARED_PREFIX_ATTENTION_ENV, "").strip()
    if name in ("", "off"):
        return None
    if name not in SHARED_PREFIX_ATTENTION:
        raise ValueError(
            f"{SHARED_PREFIX_ATTENTION_ENV}={name!r}: expected off or one of "
            f"{sorted(SHARED_PREFIX_ATTENTION)}"
        )
    return name


def shared_prefix_attention(name: str, shared: SharedPrefix, compiled: bool) -> DecodeAttention:
    """The variant `name` of SHARED_PREFIX_ATTENTION for this split, in DecodeAttention's
    signature (compiled: the engine's compiled code)."""
    return functools.partial(
        SHARED_PREFIX_ATTENTION[name], samples=shared.samples, prefix=shared.prefix,
        compiled=compiled,
    )  # fmt: skip
