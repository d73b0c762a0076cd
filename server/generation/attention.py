"""Grouped-query attention for prefill (prompt against itself) and decode (one token against
the static KV cache), by scaled_dot_product_attention with additive masks.

Decode attention comes in a few exact variants (DECODE_ATTENTION: the same math, other kernels)
because which one is fastest depends on the device, torch and the shape: on an H100 SDPA's own
choice (cuDNN) read the KV cache at ~60% of the copy ceiling (bench/RESULTS.md). The engine
times them on its device at warm-up (pick_decode_attention) and runs the fastest.

"flex" (COMPILED_DECODE_ATTENTION) is the same attention through a torch.compile'd
flex_attention: on CUDA Inductor generates its "flash-decoding" Triton kernel for it (one tile
per row and KV head holding the whole query group, so each KV head is read once; the columns
split over several blocks when rows x KV heads would leave SMs idle), a candidate for reading
the cache closer to the copy ceiling than cuDNN. Compiling costs seconds per batch size, so it
is timed only where the engine compiles (CUDA), never by a CPU server or test; any device can
force it by name.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

from ..capture_guard import apart_from_captures
from .compiling import compiles_by_default, maybe_compiled
from .switches import env_choice

__all__ = [
    "CAPTURE_ERROR_MODE",
    "COMPILED_DECODE_ATTENTION",
    "DECODE_ATTENTION",
    "DEFAULT_DECODE_ATTENTION",
    "DEFAULT_PREFILL_ATTENTION",
    "DecodeAttention",
    "MASK_BYTES",
    "PREFILL_ATTENTION",
    "PREFILL_ATTENTION_ENV",
    "PrefillBackends",
    "PrefillMasks",
    "additive_mask",
    "decode_attention",
    "decode_attention_flex",
    "decode_attention_matmul",
    "decode_attention_variant",
    "decode_attention_variants",
    "equal_parts",
    "flex_compiles_correctly",
    "mark_widths_dynamic",
    "pick_decode_attention",
    "prefill_attention",
    "prefill_backend",
    "prefill_backends",
    "prefill_mask",
    "query_blocks",
    "repeat_kv",
]

_log = logging.getLogger("rollserve.generation")

# q (b, H, D), k/v (b, Hkv, w, D), additive mask (b, w), scale -> (b, H, D).
DecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive one SDPA turns it into (0 where allowed, -inf elsewhere),
    made once per forward or step: given a bool mask, SDPA converts it in every layer (two
    kernels and a mask-sized tensor per layer and step). No temporary beyond the result (an
    inverted copy of `allowed` would be one more mask-sized boolean)."""
    return torch.full(
        allowed.shape, float("-inf"), dtype=dtype, device=allowed.device
    ).masked_fill_(allowed, 0.0)


def prefill_mask(valid: torch.Tensor, window: int | None, first_query: int = 0) -> torch.Tensor:
    """(b, 1, s - first_query, s) bool: queries at columns first_query .. s - 1 against every
    column: causal, real keys only, within the sliding window when set.

    As HF's mask for a padded batch: a query attends to the real keys at or before it, so a
    right-pad query (scoring's rows end in pads) sees the real tokens before it, as in HF. A
    query with no real key at all (a left pad) sees only itself, so its softmax is finite; its
    output is never read (real queries never attend to a pad column).

    One (b, q, s) boolean is made (MASK_BUILD_BYTES): the lone queries' own columns are set on
    its diagonal in place.
    """
    s = valid.shape[1]
    keys = torch.arange(s, device=valid.device)
    queries = keys[first_query:]
    allowed = keys[None, :] <= queries[:, None]  # (q, s) causal
    if window is not None:
        allowed = allowed & (keys[None, :] > queries[:, None] - window)
    mask = allowed[None] & valid[:, None, :]  # (b, q, s)
    alone = ~mask.any(-1)  # (b, q): queries with no real key
    # Query i (column first_query + i) against its own column: the diagonal at first_query.
    mask.diagonal(offset=first_query, dim1=1, dim2=2).masked_fill_(alone, True)
    return mask[:, None]


PREFILL_ATTENTION_ENV = "ROLLSERVE_PREFILL_ATTENTION"
# The backends prefill and scoring attention may take on CUDA (None: any, SDPA's own pick).
PrefillBackends = tuple[SDPBackend, ...] | None
# What ROLLSERVE_PREFILL_ATTENTION may name: SDPA's own pick ("sdpa"), or SDPA without its cuDNN
# backend ("efficient", the default; ignored off CUDA): for a masked attention that is the
# efficient kernel (flash takes no mask), math only for inputs it does not take. SDPA's pick on
# an H100 and an H200 is cuDNN's kernel, which builds a plan per new shape: on the H200
# (2026-11-27, profile_gpu.py "New prefill shapes") a new prefill shape cost +51-56 ms over its
# repeat with it, +7-10 ms with the efficient kernel, whose repeats were as fast (16.4-18.4 ms
# against 17.2-19.4). A request's shapes follow its prompt count and lengths, which no warm-up
# covers: in RL nearly every prefill and scoring batch is a shape the server has not seen.
PREFILL_ATTENTION: dict[str, PrefillBackends] = {
    "sdpa": None,
    "efficient": (
        SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
    ),
}  # fmt: skip
DEFAULT_PREFILL_ATTENTION = "efficient"


def prefill_backend() -> PrefillBackends:
    """The backends ROLLSERVE_PREFILL_ATTENTION (unset: DEFAULT_PREFILL_ATTENTION) holds prefill
    and scoring attention to on CUDA (None: SDPA picks among all of them); ValueError for a name
    not in PREFILL_ATTENTION."""
    name = env_choice(PREFILL_ATTENTION_ENV, PREFILL_ATTENTION, DEFAULT_PREFILL_ATTENTION)
    return PREFILL_ATTENTION[name]


def prefill_backends(
    backend: PrefillBackends, device: torch.device
) -> contextlib.AbstractContextManager[object]:
    """SDPA held to `backend` (prefill_backend) while the context lasts, on CUDA; nothing
    elsewhere or with None. Entered once per forward, around its layers: entering sdpa_kernel
    costs 10-30 us, ~1 ms of a scoring batch's host time if each of its 48 attentions did (the
    batch is host-bound on an H200). The flags are process-wide, not per thread: only the
    engine thread runs attention."""
    if backend is None or device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(list(backend))


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """q (b, H, q, D), k/v (b, Hkv, s, D), mask (b, 1, q, s) -> (b, H, q, D) by SDPA, through
    the backends a surrounding prefill_backends allows. mask None: causal, q == s (SDPA's
    is_causal: no mask, flash attention; causal_rows.py), with the K/V heads grouped, not
    repeated, where the kernel takes them so (`_grouped_causal`)."""
    if mask is None and _grouped_causal(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    k, v = repeat_kv(q.shape[1], k, v)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _grouped_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether causal SDPA should take k/v's fewer heads as they are (enable_gqa) rather than
    repeated to q's: the repeat is two copies of (b, H, s, D) a layer, which long rows (the
    causal route's) make large. On CUDA only flash attention takes grouped heads (the efficient
    and cuDNN kernels do not: SDPA would fall to its math backend, a (b, H, s, s) score
    tensor), so only where flash is enabled and takes these inputs (bfloat16 or float16, its
    head dims); on the CPU every backend does (one attention of 8 rows x 2,048 columns, 14
    heads over 2, float32: 0.80-0.85 s against 0.87-0.91 s with the repeat, the same
    numbers)."""
    if k.shape[1] == q.shape[1]:
        return False
    if q.device.type != "cuda":
        return True
    if not torch.backends.cuda.flash_sdp_enabled():
        return False
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, True)
    return torch.backends.cuda.can_use_flash_attention(params)


def repeat_kv(heads: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v (b, Hkv, s, D) with each KV head repeated for its query heads: (b, heads, s, D), as
    HF's repeat_kv (SDPA's own grouped-query mode takes no mask on its fast kernels)."""
    groups = heads // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


# The most bytes one full-sequence forward's (prefill, scoring) attention masks may take with
# their making: the additive masks (rows, 1, queries, keys) in the model dtype (one a layer
# window; scoring's shared prompts keep two sets: PrefillMasks' `parts`) and the boolean mask
# each is made of (MASK_BUILD_BYTES an element). Whole, a mask grows with the square of the rows'
# length: 16 rows of 8,192 tokens are 2 GiB of bfloat16 mask and 1 GiB of booleans, past any
# reserve of the KV budget (kv_cache.activation_reserve_bytes). (Rows of
# causal_rows.CAUSAL_MIN_COLUMNS or more make no mask at all where causal_rows.causal_layout
# allows: one run of real tokens a row, no shorter window.) Past it, a layer's attention
# runs in blocks of queries (`query_blocks`), each against the keys up to its last query (the
# causal mask hides the later ones: about half the attention's work of long rows is skipped)
# with its own block of the mask, made in every layer; under it, one mask made once per
# forward, as before (a scoring batch of 64 rows x 384 columns in bfloat16: 27 MiB). On this
# project's CPU, one forward batch of 4 rows x 6,144 tokens in float32 (bench/RESULTS.md): peak
# 873 MiB whole, 405 in blocks of this bound, and faster (2.04 s against 2.27).
MASK_BYTES = 256 << 20
MASK_BUILD_BYTES = 1  # boolean bytes per mask element while it is made (prefill_mask)


def query_blocks(
    rows: int, first_query: int, keys: int, dtype: torch.dtype, budget: int | None = None
) -> tuple[tuple[int, int], ...]:
    """(start, end) column ranges, in order, of the queries first_query .. keys - 1 whose mask
    blocks (rows x (end - start) queries x end keys, dtype) each take at most `budget` bytes
    (MASK_BYTES) with their making; one block of them all when the whole mask does, blocks of
    one query when not even that fits. Blocks of near-equal query counts."""
    budget = MASK_BYTES if budget is None else budget
    queries = keys - first_query
    per_query = rows * keys * (dtype.itemsize + MASK_BUILD_BYTES)
    size = max(1, budget // max(1, per_query))
    count = -(-queries // size)
    return tuple((first_query + a, first_query + b) for a, b in equal_parts(queries, count))


def equal_parts(size: int, parts: int) -> list[tuple[int, int]]:
    """(start, end) of `parts` slices of 0 .. size whose lengths differ by at most one (query
    blocks here; a full-sequence forward's MLP token chunks in model.py)."""
    return [(size * i // parts, size * (i + 1) // parts) for i in range(parts)]


class PrefillMasks:
    """The additive masks of one full-sequence forward for its layers' windows (prefill_mask of
    `valid` (b, s) from `first_query` on, in `dtype`), by query_blocks: made once here when
    they are one block, else per block as the attention asks (`block`).

    parts: how many PrefillMasks the forward keeps at once (scoring's shared prompts: the
    prompts' and the rest's). Each window's whole mask lives through the forward, so the bound
    a mask gets is MASK_BYTES / (parts x windows): together they stay within MASK_BYTES."""

    def __init__(
        self,
        valid: torch.Tensor,
        windows: Iterable[int | None],
        dtype: torch.dtype,
        first_query: int = 0,
        parts: int = 1,
    ) -> None:
        windows = set(windows)
        budget = MASK_BYTES // (parts * len(windows))
        self.first_query = first_query
        self.blocks = query_blocks(valid.shape[0], first_query, valid.shape[1], dtype, budget)
        self._valid, self._dtype = valid, dtype
        self._whole: dict[int | None, torch.Tensor] = {}
        if len(self.blocks) == 1:
            self._whole = {w: self._made(w, *self.blocks[0]) for w in windows}

    def block(self, window: int | None, start: int, end: int) -> torch.Tensor:
        """The additive mask (b, 1, end - start, end) of queries start .. end - 1 (columns of
        `valid`) against the keys 0 .. end - 1, under `window`; (start, end) one of `blocks`."""
        whole = self._whole.get(window)
        return whole if whole is not None else self._made(window, start, end)

    def _made(self, window: int | None, start: int, end: int) -> torch.Tensor:
        return additive_mask(prefill_mask(self._valid[:, :end], window, start), self._dtype)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per row: q (b, H, D), cache k/v (b, Hkv, w, D), mask (b, w) -> (b, H, D);
    the "sdpa" variant (SDPA picks its backend).

    The query heads of a KV head become that head's "query positions" (b, Hkv, G, D), so
    the cache is read once per KV head and never repeated.
    """
    b, heads, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.view(b, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask[:, None, None], scale=scale)
    return out.reshape(b, heads, dim)


def _sdpa_with(backend: SDPBackend) -> DecodeAttention:
    """decode_attention with SDPA held to one backend (it raises where the backend does not
    take these inputs: no fallback, so a variant's name is the kernel it runs)."""

    def attend(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
    ) -> torch.Tensor:
        # sdpa_kernel sets process-wide flags while inside (not per thread): the context spans
        # this one call, so no other SDPA call (prefill, scoring) ever runs under it. It only
        # steers the choice at call time: a CUDA graph captured here replays the kernel chosen.
        with sdpa_kernel(backend):
            return decode_attention(q, k, v, mask, scale)

    return attend


def decode_attention_matmul(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """decode_attention by two batched matmuls per KV head, as HF's eager attention computes
    it (scores in the model dtype, softmax in float32, cast back): the G query heads of a KV
    head are the rows of one (G, D) @ (D, w) product, so K and V are read once, never
    repeated. The cache views' (b, Hkv) dimensions merge without a copy."""
    b, heads, dim = q.shape
    grouped = q.view(b, k.shape[1], heads // k.shape[1], dim)
    scores = torch.matmul(grouped, k.transpose(2, 3)).mul_(scale).add_(mask[:, None, None])
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).reshape(b, heads, dim)


def _flex_grouped(
    grouped: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """flex_attention of grouped queries (b, Hkv, G, D) against k/v (b, Hkv, w, D) with the
    additive mask (b, w): the function torch.compile turns into one fused kernel.

    The mask is a score_mod (score + mask[row, column]), not a mask_mod: a mask_mod needs a
    BlockMask, which would have to be rebuilt from the step's mask in every layer and step (more
    kernels than the attention saves: the engine's masks are dense but for a few left pads and
    unwritten columns, so whole blocks are rarely skipped), while the added score is exactly
    SDPA's attn_mask: a -inf column scores -inf and gets probability exp(-inf) = 0. The block
    mask is None: dense, one block over every column (flex builds it inside the graph, where
    Inductor folds it to one fill of two integers).
    """

    def add_mask(
        score: torch.Tensor, row: torch.Tensor, head: torch.Tensor, query: torch.Tensor,
        column: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        return score + mask[row, column]

    return flex_attention(grouped, k, v, score_mod=add_mask, scale=scale)


@functools.cache
def _flex_compiled() -> Callable[..., torch.Tensor]:
    """The compiled _flex_grouped, made on first use: one per process (torch.compile keys its
    cache by function, so every engine shares its graphs). fullgraph (compiling.py), and
    dynamic=False: dynamo specialises every size but the width (decode_attention_flex marks it
    dynamic), because Inductor takes flex's decoding kernel only for a static batch and head
    count. So it compiles per (batch size, head shape, dtype, scale) and the widths and cache
    layouts of a batch size share the code, except layer 0's view: its storage offset 0 is
    specialised by dynamo (the 0/1 rule), one more compile per batch size (a handful of
    batch buckets: well within compiling.RECOMPILE_LIMIT)."""
    return maybe_compiled(_flex_grouped, True, dynamic=False)


def decode_attention_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """decode_attention by a compiled flex_attention (the "flex" variant); the cache views are
    read as they are, never copied.

    As in decode_attention the G query heads of a KV head are its G "query positions" (b, Hkv,
    G, D), not enable_gqa over (b, H, 1, D): Inductor's decoding kernel packs a power-of-two
    group only (Qwen2-0.5B's 7 would fall back to the general kernel, one 1-row query tile per
    head), while G positions of one head pack into one tile for any G. The grouped view is made
    here, outside the graph: compiled on the CPU, flex's template reads the shape of the
    buffer under a view made inside it (3-d) and fails.
    """
    b, heads, dim = q.shape
    grouped = q.view(b, k.shape[1], heads // k.shape[1], dim)
    if not flex_compiles_correctly(q.device, dim):
        if q.is_cuda:  # flex's eager form cannot be captured in a CUDA graph: the matmul one
            return decode_attention_matmul(q, k, v, mask, scale)
        return _flex_grouped(grouped, k, v, mask, scale).reshape(b, heads, dim)
    mark_widths_dynamic(k, v, mask)
    return _flex_compiled()(grouped, k, v, mask, scale).reshape(b, heads, dim)


def mark_widths_dynamic(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> None:
    """The cache views' width (k/v (b, Hkv, w, D), mask (b, w)) varies from step to step: a
    compiled attention keeps it symbolic, not a recompile per width (maybe_: if a lowering
    specialises it anyway, a recompile, not an error). Marks are for dynamo's entry: no-op
    inside a trace."""
    if not torch.compiler.is_compiling():
        for tensor, width_dim in ((k, 2), (v, 2), (mask, 1)):
            torch._dynamo.maybe_mark_dynamic(tensor, width_dim)


# Inductor's CPU flex_attention kernel computed wrong attention for head_dim 8 and 16 (torch
# 2.13 on an AVX2 AMD EPYC: outputs up to 0.6 off sdpa's; 24 and up agreed), as NATTEN found
# for compiled flex below 32. Below this head_dim the CPU runs flex's eager reference instead.
CPU_FLEX_MIN_HEAD_DIM = 32
# Inductor's CUDA flex_attention kernel refuses a head_dim under 16 ("NYI: embedding dimension
# of the query, key, and value must be at least 16", torch 2.11 on an H200, 2026-11-27), and
# flex's eager fallback cannot be captured in a CUDA graph (it copies from unpinned host memory).
CUDA_FLEX_MIN_HEAD_DIM = 16


def flex_compiles_correctly(device: torch.device, head_dim: int) -> bool:
    """Whether flex_attention's compiled kernel may serve this head_dim on `device`
    (CUDA_FLEX_MIN_HEAD_DIM and up on CUDA, CPU_FLEX_MIN_HEAD_DIM on the CPU)."""
    if device.type == "cuda":
        return head_dim >= CUDA_FLEX_MIN_HEAD_DIM
    return device.type != "cpu" or head_dim >= CPU_FLEX_MIN_HEAD_DIM


DEFAULT_DECODE_ATTENTION = "sdpa"
# Name -> variant; all take q (b, H, D), k/v (b, Hkv, w, D) (strided views of the cache), an
# additive mask (b, w) of the model dtype (0 / -inf) and the scale, and return (b, H, D). Each
# is capturable in a CUDA graph and never synchronises with the host. Only SDPA backends that
# take an arbitrary additive mask are here (flash takes none); the CUDA ones raise on the CPU.
# Not here: "flex" (COMPILED_DECODE_ATTENTION below), a compiled flex_attention whose
# flash-decoding kernel may beat cuDNN on CUDA; timed on CUDA only, its compile being seconds.
DECODE_ATTENTION: dict[str, DecodeAttention] = {
    DEFAULT_DECODE_ATTENTION: decode_attention,  # SDPA picks its backend
    "sdpa_efficient": _sdpa_with(SDPBackend.EFFICIENT_ATTENTION),
    "sdpa_cudnn": _sdpa_with(SDPBackend.CUDNN_ATTENTION),
    "matmul": decode_attention_matmul,
}
# Variants that torch.compile on their first call for a shape (seconds per batch size on a
# CPU, more with a GPU's kernel build): the same contract as DECODE_ATTENTION's, but timed only
# where the engine compiles its functions (decode_attention_variants), and forced anywhere by
# name. "flex": flex_attention's flash-decoding kernel on CUDA (decode_attention_flex).
COMPILED_DECODE_ATTENTION: dict[str, DecodeAttention] = {
    "flex": decode_attention_flex,
}
_EVERY_DECODE_ATTENTION = {**DECODE_ATTENTION, **COMPILED_DECODE_ATTENTION}


def decode_attention_variants(
    device: torch.device, compiled: bool | None = None
) -> dict[str, DecodeAttention]:
    """The variants pick_decode_attention times on `device`: DECODE_ATTENTION, and
    COMPILED_DECODE_ATTENTION where the engine compiles (`compiled`, the engine's; None:
    compiling.compiles_by_default, CUDA unless ROLLSERVE_ENGINE_COMPILE=0): a CPU server or
    test, or an engine told not to compile, never pays their compile."""
    if compiles_by_default(device) if compiled is None else compiled:
        return dict(_EVERY_DECODE_ATTENTION)
    return dict(DECODE_ATTENTION)


def decode_attention_variant(name: str) -> DecodeAttention:
    """The variant called `name` (of DECODE_ATTENTION or COMPILED_DECODE_ATTENTION, on any
    device); ValueError naming the known ones otherwise."""
    try:
        return _EVERY_DECODE_ATTENTION[name]
    except KeyError:
        names = ", ".join(_EVERY_DECODE_ATTENTION)
        raise ValueError(f"unknown decode attention variant {name!r} (known: {names})") from None


# How a CUDA graph capture (the engine's decode steps, the pick's timings) holds other threads:
# "thread_local" forbids the capturing thread alone the calls a capture cannot record. CUDA's
# default, "global", forbids them to every thread of the process: an UpdateWeights staging on a
# gRPC handler thread (event and stream synchronisations, cudaMalloc, opening a CUDA IPC
# handle) while the engine captures a request's first shape would fail, and invalidate the
# capture with it. Nothing the engine captures runs on another thread.
CAPTURE_ERROR_MODE = "thread_local"

# Calls of a variant per timed CUDA graph: a call is tens of microseconds on an H100, of the
# order of a graph launch's overhead, which a replay of several calls amortises.
_GRAPH_CALLS = 8
# A variant other than the default must beat it by this fraction to be chosen: a near tie
# keeps the default, so noise does not flip the choice (and the rounding of every rollout)
# from one server start to the next.
PICK_MARGIN = 0.03


def _tolerance(dtype: torch.dtype) -> float:
    """How far variants may differ: a few roundings of the dtype (scores rounded to bfloat16
    in "matmul", as HF's eager attention does, against SDPA's float32 scores)."""
    return max(4 * torch.finfo(dtype).eps, 1e-5)


def _agrees(out: torch.Tensor, reference: torch.Tensor) -> bool:
    if out.shape != reference.shape or out.dtype != reference.dtype:
        return False
    tol = _tolerance(reference.dtype)
    return bool(torch.allclose(out.float(), reference.float(), rtol=tol, atol=tol))


def _cpu_ms(call: Callable[[], object], warmup: int, repeats: int) -> float:
    """Median wall-clock ms of one call."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _cuda_ms(call: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median device ms of one call as the engine runs it: inside a CUDA graph (after warm-up
    calls on a side stream, as the engine's capture does), _GRAPH_CALLS calls per replay, timed
    by CUDA events between back-to-back replays (no launch gap, no host in the measure). A
    variant that cannot be captured raises here: the engine could not use it either."""
    # A stream of the high-priority pool on `device`, as the engine's captures (runner.py,
    # Engine._capture_stream: not torch's default capture stream, made on the current device).
    current, side = torch.cuda.current_stream(device), torch.cuda.Stream(device, priority=-1)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmup):
            call()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with (
        apart_from_captures(device),
        torch.cuda.graph(graph, stream=side, capture_error_mode=CAPTURE_ERROR_MODE),
    ):
        for _ in range(_GRAPH_CALLS):
            call()
    with torch.cuda.device(device):  # replays and events on `device`'s current stream
        graph.replay()  # the first replay uploads the graph
        events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
        events[0].record()
        for event in events[1:]:
            graph.replay()
            event.record()
    torch.cuda.synchronize(device)
    spans = [start.elapsed_time(end) for start, end in zip(events, events[1:], strict=False)]
    return statistics.median(spans) / _GRAPH_CALLS


def pick_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    repeats: int = 20,
    *,
    warmup: int = 2,
    variants: Mapping[str, DecodeAttention] | None = None,
) -> tuple[str, dict[str, float]]:
    """Time every variant on these tensors (by default decode_attention_variants(q.device));
    returns the fastest one's name and each variant's ms (NaN: it raised, or its output
    disagreed with the default's; both logged).

    On CUDA a variant's time is the median over `repeats` replays of a graph of its calls
    (_cuda_ms; this synchronises: run it at warm-up only), elsewhere the median wall clock
    of `repeats` calls after `warmup`. The default ("sdpa", what the forward ran before the
    variants) is the reference every output is checked against and the choice unless another
    is PICK_MARGIN faster; it must be among `variants` and must run.
    """
    if variants is None:
        variants = decode_attention_variants(q.device)
    reference = variants[DEFAULT_DECODE_ATTENTION](q, k, v, mask, scale)
    timings: dict[str, float] = {}
    for name, variant in variants.items():
        timings[name] = math.nan
        call = functools.partial(variant, q, k, v, mask, scale)
        try:
            if not _agrees(call(), reference):
                _log.warning("decode attention %s disagrees with %s: not used", name,
                             DEFAULT_DECODE_ATTENTION)  # fmt: skip
                continue
            if q.device.type == "cuda":
                timings[name] = _cuda_ms(call, q.device, warmup, repeats)
            else:
                timings[name] = _cpu_ms(call, warmup, repeats)
        except Exception as error:  # noqa: BLE001 - a variant that cannot run is not a choice
            first = str(error).splitlines()[0] if str(error) else ""
            # Expected off CUDA (the CUDA backends), worth a look on it.
            level = logging.WARNING if q.is_cuda else logging.INFO
            _log.log(level, "decode attention %s failed (%s: %s)", name, type(error).__name__,
                     first)  # fmt: skip
    return _fastest(timings), timings


def _fastest(timings: dict[str, float]) -> str:
    measured = {name: ms for name, ms in timings.items() if not math.isnan(ms)}
    if not measured:
        return DEFAULT_DECODE_ATTENTION
    best = min(measured, key=measured.__getitem__)
    default = measured.get(DEFAULT_DECODE_ATTENTION)
    if default is not None and measured[best] > default * (1 - PICK_MARGIN):
        return DEFAULT_DECODE_ATTENTION
    return best
