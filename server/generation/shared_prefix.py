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
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from .attention import DecodeAttention, flex_compiles_correctly, mark_widths_dynamic
from .compiling import maybe_compiled
from .switches import env_choice

__all__ = [
    "SHARED_PREFIX_ATTENTION",
    "SHARED_PREFIX_ATTENTION_ENV",
    "SHARED_PREFIX_QUANTUM",
    "SharedPrefix",
    "shared_prefix_attention",
    "shared_prefix_decode_attention",
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


def _flex_part(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """_matmul_part's contract by flex_attention, the additive mask a score_mod (as
    attention._flex_grouped)."""

    def add_mask(
        score: torch.Tensor, row: torch.Tensor, head: torch.Tensor, query: torch.Tensor,
        column: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        return score + mask[row, column]

    out, aux = flex_attention(
        q, k, v, score_mod=add_mask, scale=scale, return_aux=AuxRequest(lse=True)
    )
    return out, aux.lse


Part = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _cascade(
    part: Part,
    by_group: torch.Tensor,
    grouped: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    own: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """The attention (b, Hkv, G, D) of the grouped queries as `part` of their groups' blocks
    (by_group) over each group's shared (k, v, mask), `part` of each row's over its own
    columns' (k, v, mask), merged. Every view is made by the caller: none inside a compiled
    graph (Inductor's CPU flex template misreads a view made inside it; the CUDA one is not
    given the chance)."""
    samples = grouped.shape[0] // by_group.shape[0]
    group = grouped.shape[2]
    shared_out, shared_lse = part(by_group, *shared, scale)
    first = (_by_row(shared_out, samples, group), _by_row(shared_lse, samples, group))
    return _merge((first, part(grouped, *own, scale)), grouped.dtype)


def _shared_matmul(*args: object) -> torch.Tensor:
    return _cascade(_matmul_part, *args)


def _shared_flex(*args: object) -> torch.Tensor:
    return _cascade(_flex_part, *args)


# form -> (its cascade, whether torch.compile may build it on the CPU: Inductor's CPU flex
# kernel returns no log-sum-exp in torch 2.13).
_FORMS: dict[str, tuple[Callable[..., torch.Tensor], bool]] = {
    "matmul": (_shared_matmul, True),
    "flex": (_shared_flex, False),
}


@functools.cache
def _compiled(form: str) -> Callable[..., torch.Tensor]:
    """The form's cascade compiled whole (one per process and form): fullgraph; static shapes
    but the width, which the caller marks dynamic (Inductor's flex decoding kernel wants a
    static batch; a new batch size compiles once more, as the engine's warm-up does per
    bucket)."""
    return maybe_compiled(_FORMS[form][0], True, dynamic=False)


def shared_prefix_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    *,
    form: str,
    samples: int,
    prefix: int,
    compiled: bool = False,
) -> torch.Tensor:
    """decode_attention's contract (q (b, H, D), k/v (b, Hkv, w, D) cache views, additive mask
    (b, w) -> (b, H, D)) for groups of `samples` rows sharing columns [0, prefix), in `form`:
    "matmul" (HF's eager numerics; `compiled`: torch.compile'd on any device) or "flex" (two
    flex_attention calls; `compiled`: on CUDA only, else flex's eager reference, which
    materialises every score). The query blocks are made here, outside any compiled graph (as
    attention's flex variant: Inductor's CPU flex template reads the shape of the buffer under
    a view made inside it), and so are the K/V views of both parts."""
    b, heads, dim = q.shape
    grouped = q.view(b, k.shape[1], heads // k.shape[1], dim)
    by_group = _by_group(grouped, samples).contiguous()
    shared = (k[::samples, :, :prefix], v[::samples, :, :prefix], mask[::samples, :prefix])
    own = (k[:, :, prefix:], v[:, :, prefix:], mask[:, prefix:])
    if form == "flex" and q.is_cuda and not flex_compiles_correctly(q.device, dim):
        form = "matmul"  # CUDA's flex kernel refuses it (a trace-time choice: head_dim is static)
    cascade, compiles_on_cpu = _FORMS[form]
    if compiled and (compiles_on_cpu or q.is_cuda):
        mark_widths_dynamic(*own)  # the shared part's width is the prefix: fixed
        cascade = _compiled(form)
    return cascade(by_group, grouped, shared, own, scale).reshape(b, heads, dim)


def shared_prefix_variants(
    shared: SharedPrefix, device: torch.device, compiled: bool
) -> dict[str, DecodeAttention]:
    """The shared-prefix variants for this split, in DecodeAttention's signature (for
    attention.pick_decode_attention): "matmul_shared" always, "flex_shared" where `compiled`
    and on CUDA (eager flex materialises every score: a reference, not a candidate)."""
    names = ["matmul_shared"] + (["flex_shared"] if compiled and device.type == "cuda" else [])
    return {name: shared_prefix_attention(name, shared, compiled) for name in names}


# What ROLLSERVE_SHARED_PREFIX_ATTENTION may name (the engine's attention for grouped batches):
# variant name -> its form of shared_prefix_decode_attention.
SHARED_PREFIX_ATTENTION: dict[str, str] = {"matmul_shared": "matmul", "flex_shared": "flex"}
SHARED_PREFIX_ATTENTION_ENV = "ROLLSERVE_SHARED_PREFIX_ATTENTION"


def shared_prefix_from_env() -> str | None:
    """The shared-prefix variant ROLLSERVE_SHARED_PREFIX_ATTENTION names (None: unset, empty or
    "off", the default: every batch runs the plain decode attention); ValueError for a name not
    in SHARED_PREFIX_ATTENTION."""
    name = env_choice(SHARED_PREFIX_ATTENTION_ENV, {"off", *SHARED_PREFIX_ATTENTION}, "off")
    return None if name == "off" else name


def shared_prefix_attention(name: str, shared: SharedPrefix, compiled: bool) -> DecodeAttention:
    """The variant `name` of SHARED_PREFIX_ATTENTION for this split, in DecodeAttention's
    signature (compiled: the engine's compiled code)."""
    return functools.partial(
        shared_prefix_decode_attention, form=SHARED_PREFIX_ATTENTION[name],
        samples=shared.samples, prefix=shared.prefix, compiled=compiled,
    )  # fmt: skip
