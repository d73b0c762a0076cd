"""The engine: prefill into a static KV cache, then a static-shape decode loop.

Per step the device does everything (forward, sampling, stop matching, recording the token,
its log-prob and mask into per-request tables); the host only counts live rows every
CHECK_EVERY steps, ends the loop when none is left and moves the live rows to the front of
the next smaller batch-size bucket. A step attends to the cache columns written so far only
(the live width, rounded up: attention_width), so each (bucket, attention width) is its own
static step. On CUDA each is captured as a CUDA graph the first time it runs (after one eager
run that warms it up) and replayed after that; warm_up runs them all for a shape before the
server reports SERVING. Workspaces (and their graphs) are keyed by the layout and the sampling
structure only: temperature, top-p and min_new_tokens are device tensors the step reads. The
graphs read the model's parameter storages, so a weight update that swaps a storage (rather
than copying into it) must drop them: generate() checks the parameters' addresses and calls
invalidate() itself when they changed. memory() reports what the engine holds on the device.
On CUDA the first warm-up also times the decode attention variants (attention.py) on the device
and keeps the fastest (decode_attention, decode_attention_ms), before any graph is captured.
With ROLLSERVE_SHARED_PREFIX_ATTENTION (shared_prefix.py; off by default) a batch whose rows
are groups of one prompt each (a GRPO request) reads each group's prompt columns once: its
steps are keyed apart (they run another attention) until rows finish and the live ones move
to a smaller bucket, no longer whole groups; the warm-up builds them for groups of
WARM_UP_SAMPLES rows.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..capture_guard import captures_now
from .attention import CAPTURE_ERROR_MODE, decode_attention_variants, pick_decode_attention
from .compiling import compiles_by_default
from .families import Family
from .fused import fuses_by_default
from .kv_cache import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    KVCache,
    activation_reserve_bytes,
    default_capacity_tokens,
)
from .model import Forward
from .rotary import RopeTable
from .sampler import Sampler, sampler_structure
from .shared_prefix import SharedPrefix, shared_prefix_from_env

__all__ = [
    "ATTENTION_QUANTUM",
    "Engine",
    "EngineMemory",
    "EngineResult",
    "attention_width",
    "batch_bucket",
]

# Batch sizes a step runs at (rows beyond the live ones are finished fillers): a ~1.5x ladder
# keeps the number of captured graphs small and the filler work under a third.
_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
CHECK_EVERY = 8  # decode steps between the host's looks at finished rows
WIDTH_QUANTUM = 128  # layouts are a multiple of this many columns wide
# A step's attention reads the written columns rounded up to this (attention_width). Every
# width is one more captured graph per bucket (a capture, no compile: the attention runs
# outside the compiled functions, and the compiled variants' widths are dynamic); halving 128
# cut the columns read beyond the live ones from a quarter to an eighth of a 128 + 256 request.
ATTENTION_QUANTUM = 64
PREFILL_TOKENS = 8192  # prompt tokens per prefill forward (rows are chunked to fit)
MAX_WORKSPACES = 4  # layouts x sampling structures kept with their graphs
WARM_UP_BUDGET_S = 60.0  # the warm-up starts no new batch bucket after this (it delays SERVING)
# Rows per group of the shared-prefix steps the warm-up builds (with a shared-prefix attention):
# GRPO's common 8 samples per prompt; a request of another count builds its steps on first use.
WARM_UP_SAMPLES = 8
# A decode attention variant's name (attention.py's DECODE_ATTENTION): the engine runs it and
# times none (reruns of a measured choice, tests on the CPU, where nothing is timed).
DECODE_ATTENTION_ENV = "ROLLSERVE_DECODE_ATTENTION"
_log = logging.getLogger("rollserve.generation")


def batch_bucket(rows: int, cap: int) -> int:
    """The smallest ladder size >= rows, or `cap` when the ladder passes it."""
    for size in _LADDER:
        if size >= rows:
            return min(size, cap)
    return min(-(-rows // 1024) * 1024, cap)


def _round_up(value: int, quantum: int) -> int:
    return -(-value // quantum) * quantum


def attention_width(live: int, layout_width: int) -> int:
    """The cache columns a step reads for `live` written columns: live rounded up to
    ATTENTION_QUANTUM up to 16 quanta, then to a sixteenth of the power of two above it (8
    widths per doubling: a step reads at most an eighth more than live, and a long layout
    needs few graphs per bucket), never past the layout."""
    quantum = max(ATTENTION_QUANTUM, 1 << max(0, (live - 1).bit_length() - 4))
    return min(layout_width, _round_up(live, quantum))


@dataclass(frozen=True)
class EngineResult:
    """Per-row results in batch order, M = max_new_tokens columns."""

    response: torch.Tensor  # (B, M) int64, pad where not generated
    log_probs: torch.Tensor  # (B, M) float32, 0 where not generated
    response_mask: torch.Tensor  # (B, M) bool
    stopped: torch.Tensor  # (B,) bool


@dataclass(frozen=True)
class EngineMemory:
    """Device memory of an engine's model, in bytes (Engine.memory). The device figures are
    the caching allocator's (torch.cuda, since the last reset_peak_memory_stats; 0 off CUDA);
    budget is --gpu-memory-utilization x the device's total (0 off CUDA)."""

    weights: int  # the model's parameters
    kv_cache: int  # the KV buffer allocated now (the largest layout asked for so far)
    kv_capacity: int  # the KV budget (capacity_tokens x bytes per token)
    graphs: int  # captured decode-step graphs
    graph_pool: int  # bytes of the graphs' private pool (-1: unknown)
    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    budget: int

    def as_info(self) -> dict[str, float]:
        """The figures in GiB (counts as they are), for logs and bench tables."""
        gib = float(1 << 30)
        return {
            name: (value if name == "graphs" else value / gib)
            for name, value in self.__dict__.items()
        }


@dataclass
class _Workspace:
    """Static buffers of one layout (rows R, width W) and sampling setting, and its graphs.

    Rows are cache rows; row_ids maps each to its output row (R = a junk row for fillers).
    """

    rows: int
    width: int
    sampler: Sampler
    pad: int
    k: torch.Tensor  # (layers, R, Hkv, W, D)
    v: torch.Tensor
    tokens: torch.Tensor  # (R,) the token each row feeds next
    positions: torch.Tensor  # (R,) its position id
    valid: torch.Tensor  # (R, W) bool: columns a row attends to
    window: torch.Tensor  # (R, stop width) the last tokens, for stop matching
    finished: torch.Tensor  # (R,) bool
    row_ids: torch.Tensor  # (R,) output row of each cache row
    step: torch.Tensor  # () int64: the step being sampled
    prompt_width: torch.Tensor  # () int64: P
    out_tokens: torch.Tensor  # (R + 1, W) int64
    out_log_probs: torch.Tensor  # (R + 1, W) float32
    out_mask: torch.Tensor  # (R + 1, W) bool
    stopped: torch.Tensor  # (R + 1,) bool
    uniform: torch.Tensor  # (R + 1, W) float64: the random number of each row and step
    graphs: dict[tuple[int, ...], object] = field(default_factory=dict)
    # (bucket, attention width) of every step run so far, + (samples, prefix) of a step whose
    # attention read shared prompts: what a warm-up covered (and, on CUDA, which graphs exist;
    # the graphs themselves are only captured there).
    shapes: set[tuple[int, ...]] = field(default_factory=set)
    # The current batch's groups of rows sharing their prompt columns, when the engine's
    # decode attention reads them once (Engine.shared_attention); None: plain attention.
    shared: SharedPrefix | None = None

    @classmethod
    def allocate(
        cls, k: torch.Tensor, v: torch.Tensor, width: int, sampler: Sampler, pad: int
    ) -> _Workspace:
        rows, device = k.shape[1], k.device

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            rows=rows, width=width, sampler=sampler, pad=pad, k=k, v=v,
            tokens=zeros(rows), positions=zeros(rows), valid=zeros(rows, width, dtype=torch.bool),
            window=zeros(rows, sampler.window), finished=zeros(rows, dtype=torch.bool),
            row_ids=zeros(rows), step=zeros(), prompt_width=zeros(),
            out_tokens=zeros(rows + 1, width),
            out_log_probs=zeros(rows + 1, width, dtype=torch.float32),
            out_mask=zeros(rows + 1, width, dtype=torch.bool),
            stopped=zeros(rows + 1, dtype=torch.bool),
            uniform=zeros(rows + 1, width, dtype=torch.float64),
        )  # fmt: skip


def _shared_prefix(of_row: torch.Tensor, bucket: int, prompt_width: int) -> SharedPrefix | None:
    """The shared prompt columns of a batch whose rows are groups of n consecutive rows of one
    prompt each (a GRPO request's layout; prefill copied each group's K/V to its rows), n >= 2
    dividing the bucket (its filler rows make whole groups too); None otherwise. One host
    look at the rows' prompts per batch."""
    prompts = of_row.tolist()
    rows = len(prompts)
    samples = next((i for i, p in enumerate(prompts) if p != prompts[0]), rows)
    if samples < 2 or rows % samples or bucket % samples:
        return None
    for start in range(0, rows, samples):
        if prompts[start : start + samples].count(prompts[start]) != samples:
            return None
    return SharedPrefix.of_layout(samples, prompt_width)


def _step_key(b: int, attend: int, shared: SharedPrefix | None) -> tuple[int, ...]:
    """A decode step's shape: its graph's key and what ws.shapes records."""
    return (b, attend) if shared is None else (b, attend, shared.samples, shared.prefix)


def _kv_writer(
    ws: _Workspace, width: int, targets: torch.Tensor, take: torch.Tensor
) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
    """Prefill's K/V sink: prompt `take[i]` of the chunk goes to cache row `targets[i]`."""

    def write(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        ws.k[layer, :, :, :width].index_copy_(0, targets, k[take])
        ws.v[layer, :, :, :width].index_copy_(0, targets, v[take])

    return write


class Engine:
    """Generation for one supported model (see families.py), owning its KV cache and graphs."""

    def __init__(
        self,
        model: torch.nn.Module,
        family: Family,
        *,
        kv_cache_tokens: int | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        staging_reserve_bytes: int = 0,
        cuda_graphs: bool = True,
        compiled: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        # Weakly: the registry maps model -> engine in a WeakKeyDictionary, whose value must not
        # hold its key (the model, its KV cache and graphs would then never be freed).
        self._model = weakref.ref(model)
        self.family = family
        weight = family.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        if compiled is None:  # default: on CUDA, unless ROLLSERVE_ENGINE_COMPILE=0
            compiled = compiles_by_default(self.device)
        self.compiled = compiled
        rope = RopeTable(family.rotary, family.max_positions, self.dtype)
        if fused is None:  # default: on CUDA, unless ROLLSERVE_FUSED_PROJECTIONS=0
            fused = fuses_by_default(self.device)
        # Before the parameter addresses are taken below: fusing moves the projections' weights.
        self.forward = Forward(family, rope, compiled=compiled, fused=fused)
        if self.forward.fused_projections and self.device.type == "cuda":
            # Fusing left the projections' old storages cached by the allocator, where
            # mem_get_info (the KV budget below) would count them as in use: give them back.
            torch.cuda.empty_cache()
        forced = os.environ.get(DECODE_ATTENTION_ENV, "").strip()
        if forced:
            self.forward.decode_attention_variant = forced  # ValueError for an unknown name
        # ROLLSERVE_SHARED_PREFIX_ATTENTION (off by default; ValueError for an unknown name):
        # the attention of batches whose rows are groups sharing a prompt (shared_prefix.py).
        self.shared_attention = shared_prefix_from_env()
        if self.shared_attention is not None:
            self.forward.shared_attention_variant = self.shared_attention
        # Each variant's ms as the warm-up timed them (NaN: failed or disagreed; empty: none
        # timed, off CUDA or forced). Settled: forced, or picked once (graphs keep it).
        self.decode_attention_ms: dict[str, float] = {}
        self._attention_settled = bool(forced)
        layers = len(family.layers)
        probe = KVCache(layers, family.num_kv_heads, family.head_dim, self.dtype, self.device, 1)
        # kv_cache_tokens None or 0: derived from the memory budget (kv_cache.py), less
        # staging_reserve_bytes for the device staging copies of weight updates (registry.py).
        capacity = kv_cache_tokens or default_capacity_tokens(
            probe.token_bytes, self.device, gpu_memory_utilization,
            activation_reserve_bytes(family.vocab) + staging_reserve_bytes,
        )  # fmt: skip
        self.gpu_memory_utilization = gpu_memory_utilization
        self.cache = KVCache(
            layers, family.num_kv_heads, family.head_dim, self.dtype, self.device, capacity
        )
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self._workspaces: dict[tuple, _Workspace] = {}
        self._cache_generation = self.cache.generation
        self._fingerprint = self._parameter_addresses()
        self._pool = None
        self._graph_stream: torch.cuda.Stream | None = None  # _capture_stream's, once made
        # One request at a time: the KV cache, the workspaces and the graphs are shared.
        self._lock = threading.Lock()

    # ---- lifetime ---------------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The HF module whose parameters the engine runs (alive while the engine is used)."""
        model = self._model()
        if model is None:
            raise RuntimeError("the engine's model was freed")
        return model

    def _parameter_addresses(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def invalidate(self) -> None:
        """Drop every captured graph and workspace (they are rebuilt on the next request)."""
        self._workspaces.clear()
        self._pool = None

    def _check_storages(self) -> None:
        """Graphs read parameters by address: a swapped storage (not a copy into it) or a
        reallocated cache makes them stale."""
        addresses = self._parameter_addresses()
        if addresses != self._fingerprint or self.cache.generation != self._cache_generation:
            self.invalidate()
            self._fingerprint = addresses
            self._cache_generation = self.cache.generation

    @property
    def capacity_tokens(self) -> int:
        return self.cache.capacity_tokens

    @property
    def decode_attention(self) -> str:
        """The decode attention variant the steps run (attention.py's DECODE_ATTENTION)."""
        return self.forward.decode_attention_variant

    def memory(self) -> EngineMemory:
        """What the engine and its model hold on the device now, and the device's peaks: the
        figures the memory target is read from (weights + KV of the batch + graph pool +
        scoring temporaries, within the budget)."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        kv = self.cache.allocated_bytes
        capacity = self.cache.capacity_tokens * self.cache.token_bytes
        graphs = sum(len(ws.graphs) for ws in self._workspaces.values())
        if self.device.type != "cuda":
            return EngineMemory(weights, kv, capacity, graphs, 0, 0, 0, 0, 0, 0)
        cuda = torch.cuda
        total = cuda.get_device_properties(self.device).total_memory
        return EngineMemory(
            weights, kv, capacity, graphs, self._graph_pool_bytes(),
            cuda.memory_allocated(self.device), cuda.memory_reserved(self.device),
            cuda.max_memory_allocated(self.device), cuda.max_memory_reserved(self.device),
            int(total * self.gpu_memory_utilization),
        )  # fmt: skip

    def _graph_pool_bytes(self) -> int:
        """Bytes of the segments in the graphs' private pool (the allocator's snapshot)."""
        if self._pool is None:
            return 0
        try:
            segments = torch.cuda.memory._snapshot(self.device)["segments"]
            pool = tuple(self._pool)
            return sum(
                seg["total_size"]
                for seg in segments
                if tuple(seg.get("segment_pool_id", ())) == pool
            )
        except Exception:  # noqa: BLE001 - a private API: report unknown rather than fail
            return -1

    def fits(self, prompt_width: int, max_new_tokens: int) -> bool:
        """Whether one row of this shape fits the KV budget (else the caller uses HF)."""
        return self.cache.rows_for(_round_up(prompt_width + max_new_tokens, WIDTH_QUANTUM)) >= 1

    # ---- one request ------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: object,
        *,
        pad_token_id: int,
        generator: torch.Generator,
        share_prefill: bool = True,
    ) -> EngineResult:
        """Sample params.max_new_tokens columns for left-padded prompts (B, P) on the device.

        Rows are generated in batches of what the KV budget holds; every row's random numbers
        are drawn up front from `generator` (B, M), so the tokens do not depend on the split.
        """
        batch, width = prompt_ids.shape
        steps = params.max_new_tokens
        uniform = None
        if params.temperature > 0:
            uniform = torch.rand(
                (batch, steps), generator=generator, dtype=torch.float64, device=self.device
            )
        with self._lock, torch.inference_mode():
            ws = self.workspace(batch, width, params, pad_token_id)
            parts = []
            for start in range(0, batch, ws.rows):
                rows = slice(start, min(start + ws.rows, batch))
                u = None if uniform is None else uniform[rows]
                ids, mask = prompt_ids[rows], prompt_mask[rows]
                parts.append(self._batch(ws, ids, mask, u, steps, share_prefill))
        return EngineResult(*(torch.cat(p, dim=0) for p in zip(*parts, strict=True)))

    def warm_up(
        self,
        params: object,
        rows: int,
        prompt_width: int,
        *,
        pad_token_id: int,
        budget_s: float = WARM_UP_BUDGET_S,
    ) -> float:
        """Build now (before a server reports SERVING) what requests of this shape would build
        on their path: the workspace of the layout (prompt_width + max_new_tokens, rounded up
        to WIDTH_QUANTUM) and the sampling structure (sampler_structure: temperature, top-p
        and min_new_tokens are values, so any request of the structure reuses it), and the
        decode step of every batch bucket up to rows' (the bucket a batch starts at and the
        smaller ones its finished rows move it to) at every attention width the request steps
        through, and those a request of shorter prompts in the same layout would, compiled and
        (CUDA) captured. One step per (bucket, width) on dummy prompts,
        not a whole request. No bucket is started after budget_s (counted from the first bucket,
        after the decode attention pick); returns the seconds, the pick included."""
        start = time.perf_counter()
        steps = params.max_new_tokens
        with self._lock, torch.inference_mode():
            ws = self.workspace(rows, prompt_width, params, pad_token_id)
            top = batch_bucket(rows, ws.rows)
            buckets = [top] + sorted({size for size in _LADDER if size < top}, reverse=True)
            first_step: dict[int, int] = {}  # attention width -> the first step that reads it
            for step in range(1, steps):
                attend = attention_width(prompt_width + step, ws.width)
                first_step.setdefault(attend, step)
            # A request of shorter prompts shares the layout (and so this workspace) and also
            # reads the widths below the first one here: their plain steps too (shared-prefix
            # steps are keyed by the prompt width: those of another width build on first use).
            below = sorted(
                {attention_width(live, ws.width) for live in range(1, prompt_width + 1)}
                - set(first_step)
            )
            if self.device.type == "cuda" and not self._attention_settled and first_step:
                if self._pick_decode_attention(ws, top, max(first_step)):
                    self.invalidate()  # graphs captured with the old variant
                    ws = self.workspace(rows, prompt_width, params, pad_token_id)
            # The budget bounds the buckets, not the pick above: a one-time cost per engine
            # (the compiled variants compile there) would otherwise leave buckets unwarmed.
            buckets_start = time.perf_counter()
            covered = []
            for b in buckets:
                if covered and time.perf_counter() - buckets_start > budget_s:
                    break
                ids = torch.ones((b, prompt_width), dtype=torch.long, device=self.device)
                mask = torch.ones_like(ids, dtype=torch.bool)
                uniform = None
                if not ws.sampler.greedy:
                    uniform = torch.full((b, steps), 0.5, dtype=torch.float64, device=self.device)
                self.start(ws, ids, mask, uniform, steps, share=True)  # one distinct prompt
                for shared in self._warm_up_splits(b, prompt_width):
                    ws.shared = shared  # the dummy rows share one prompt: any grouping holds
                    for attend, step in first_step.items():
                        ws.step.fill_(step)
                        self._run(ws, b, attend, wait_to_capture=True)
                ws.shared = None
                for attend in below:
                    ws.prompt_width.fill_(attend - 1)  # its K/V column inside what it reads
                    ws.step.fill_(1)
                    self._run(ws, b, attend, wait_to_capture=True)
                covered.append(b)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        _log.info(
            "engine warm-up in %.2f s: batch buckets %s%s x attention widths %s, %d graphs, "
            "decode attention %s, shared-prefix attention %s",
            seconds, covered, f" (not {buckets[len(covered):]}: over {budget_s:.0f} s)"
            if len(covered) < len(buckets) else "", sorted({*first_step, *below}), len(ws.graphs),
            self.decode_attention, self.shared_attention or "off",
        )  # fmt: skip
        return seconds

    def _warm_up_splits(self, b: int, prompt_width: int) -> list[SharedPrefix | None]:
        """The attentions the warm-up builds a bucket's steps for: the plain one, and with a
        shared-prefix attention, its steps for groups of WARM_UP_SAMPLES rows (a GRPO request
        of that many samples per prompt then compiles and captures nothing)."""
        splits: list[SharedPrefix | None] = [None]
        if self.shared_attention is not None and b % WARM_UP_SAMPLES == 0:
            shared = SharedPrefix.of_layout(WARM_UP_SAMPLES, prompt_width)
            if shared is not None:
                splits.append(shared)
        return splits

    def _pick_decode_attention(self, ws: _Workspace, b: int, width: int) -> bool:
        """Time the decode attention variants on the widest step the warm-up runs (bucket b,
        `width` columns) and run the fastest from now on. The K/V are layer 0's cache views of
        the workspace, so the strides are the real ones (filled with random numbers for the
        check of the outputs, zeros again after); q is random, no column is masked. Returns
        whether graphs captured with another variant exist (the caller drops them)."""
        f = self.family
        g = torch.Generator(device=self.device).manual_seed(0)
        q = torch.randn((b, f.num_heads, f.head_dim), generator=g, dtype=self.dtype,
                        device=self.device)  # fmt: skip
        k, v = ws.k[0, :b, :, :width], ws.v[0, :b, :, :width]
        mask = torch.zeros((b, width), dtype=self.dtype, device=self.device)
        k.normal_(generator=g)
        v.normal_(generator=g)
        try:
            variants = decode_attention_variants(self.device, self.compiled)
            name, timings = pick_decode_attention(q, k, v, mask, f.scaling, variants=variants)
        finally:
            k.zero_()  # as the cache was allocated (kv_cache.py)
            v.zero_()
        stale = name != self.decode_attention and any(w.graphs for w in self._workspaces.values())
        self.forward.decode_attention_variant = name
        self.decode_attention_ms = timings
        self._attention_settled = True
        _log.info(
            "decode attention (%d rows x %d columns): %s -> %s", b, width,
            ", ".join(f"{n} failed" if math.isnan(ms) else f"{n} {ms:.3f} ms"
                      for n, ms in timings.items()), name,
        )  # fmt: skip
        return stale

    def workspace(
        self, batch: int, prompt_width: int, params: object, pad_token_id: int
    ) -> _Workspace:
        """The workspace (layout, sampler, state, graphs) for a request of this shape, with
        the request's sampling values loaded; call under torch.inference_mode().

        Keyed by the layout and the sampling structure only: requests that differ in
        temperature, top-p or min_new_tokens replay the same graphs (the values are device
        tensors the step reads). A workspace of more rows serves a smaller batch of its layout
        (its buckets' graphs read the first rows): a request's last, smaller generation batch
        or a smaller request replays what the warm-up built, instead of capturing it all again
        in a workspace of its own. Kept by last use (MAX_WORKSPACES)."""
        layout_width = _round_up(prompt_width + params.max_new_tokens, WIDTH_QUANTUM)
        rows = batch_bucket(batch, self.cache.rows_for(layout_width))
        if self.cache.grows_for(rows, layout_width):
            self.invalidate()  # the workspaces' views keep the old buffer alive: drop them first
        k, v = self.cache.view(rows, layout_width)
        self.forward.refresh_fused()  # before the address check: a repair restores them
        self._check_storages()
        shape = (layout_width, sampler_structure(params, self.family.vocab), pad_token_id)
        larger = [key for key in self._workspaces if key[1:] == shape and key[0] >= rows]
        key = min(larger) if larger else (rows, *shape)
        ws = self._workspaces.pop(key, None)
        if ws is None:
            if len(self._workspaces) >= MAX_WORKSPACES:
                self._workspaces.pop(next(iter(self._workspaces)))  # the least recently used
            sampler = Sampler(params, self.family.vocab, self.device, compiled=self.compiled)
            ws = _Workspace.allocate(k, v, layout_width, sampler, pad_token_id)
        else:
            ws.sampler.load(params)
        self._workspaces[key] = ws  # the most recently used: last
        return ws

    def _batch(
        self,
        ws: _Workspace,
        ids: torch.Tensor,
        mask: torch.Tensor,
        uniform: torch.Tensor | None,
        steps: int,
        share: bool,
    ) -> tuple[torch.Tensor, ...]:
        """One batch of n <= R rows: prefill, sample step 0, decode the rest."""
        n, width = ids.shape
        b = self.start(ws, ids, mask, uniform, steps, share)
        for step in range(1, steps):
            if step % CHECK_EVERY == 0:
                live = int((~ws.finished[:b]).sum())  # the host's one look every few steps
                if live == 0:
                    break
            attend = attention_width(width + step, ws.width)
            if step % CHECK_EVERY == 0 and batch_bucket(live, ws.rows) < b:
                b = self._compact(ws, b, batch_bucket(live, ws.rows), attend)
            self._run(ws, b, attend)
        return (
            ws.out_tokens[:n, :steps].clone(),
            ws.out_log_probs[:n, :steps].clone(),
            ws.out_mask[:n, :steps].clone(),
            ws.stopped[:n].clone(),
        )

    def start(
        self,
        ws: _Workspace,
        ids: torch.Tensor,
        mask: torch.Tensor,
        uniform: torch.Tensor | None,
        steps: int,
        share: bool,
    ) -> int:
        """Reset the workspace for n rows, prefill them and sample step 0; returns the bucket
        the decode steps run at. For an engine with a shared-prefix attention, ws.shared says
        whether the rows come in groups of one prompt (_shared_prefix; never without `share`:
        each row is then its own prompt)."""
        b = batch_bucket(ids.shape[0], ws.rows)
        self._reset(ws, mask, uniform, steps)
        logits, of_row = self._prefill(ws, ids, mask, b, share)
        ws.shared = None
        if self.shared_attention is not None:
            ws.shared = _shared_prefix(of_row, b, ids.shape[1])
        self._sample_into(ws, b, logits)
        ws.step += 1
        return b

    def _reset(
        self, ws: _Workspace, mask: torch.Tensor, uniform: torch.Tensor | None, steps: int
    ) -> None:
        n, width = mask.shape
        ws.finished.fill_(True)
        ws.finished[:n] = False
        ws.row_ids.fill_(ws.rows)  # fillers write to the junk row
        ws.row_ids[:n] = torch.arange(n, device=self.device)
        ws.valid.zero_()
        ws.valid[:n, :width] = mask
        ws.window.fill_(ws.pad)
        ws.tokens.fill_(ws.pad)
        ws.positions.zero_()
        ws.positions[:n] = mask.long().sum(-1)  # the first response token's position id
        ws.step.zero_()
        ws.prompt_width.fill_(width)
        ws.out_tokens.fill_(ws.pad)
        ws.out_log_probs.zero_()
        ws.out_mask.zero_()
        ws.stopped.zero_()
        if uniform is not None:
            ws.uniform[:n, :steps] = uniform

    # ---- prefill ----------------------------------------------------------------------------

    def _prefill(
        self, ws: _Workspace, ids: torch.Tensor, mask: torch.Tensor, b: int, share: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the prompts into the cache; last-position logits (b, V) (zeros for fillers) and
        each row's prompt (n,): the index of its distinct prompt.

        With `share`, each distinct prompt runs once and its K/V and logits are copied to
        every row that has it (a GRPO group).
        """
        n, width = ids.shape
        if share:
            distinct, of_row = torch.unique(torch.where(mask, ids, -1), dim=0, return_inverse=True)
            first = torch.full((distinct.shape[0],), n, dtype=torch.long, device=self.device)
            first.scatter_reduce_(0, of_row, torch.arange(n, device=self.device), "amin")
        else:
            first, of_row = torch.arange(n, device=self.device), torch.arange(n, device=self.device)
        logits = torch.zeros((b, self.family.vocab), dtype=self.dtype, device=self.device)
        chunk = max(1, PREFILL_TOKENS // width)
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        for start in range(0, first.numel(), chunk):
            sources = first[start : start + chunk]  # (c,) rows whose prompts run
            # Every row whose prompt is one of these, and the chunk-local prompt it copies.
            local = of_row - start
            targets = ((local >= 0) & (local < sources.numel())).nonzero().squeeze(1)
            take = local[targets]
            write = _kv_writer(ws, width, targets, take)
            hidden = self.forward.prefill(ids[sources], mask[sources], positions[sources], write)
            logits[targets] = self.forward.logits(hidden[:, -1])[take]
        return logits, of_row

    # ---- decode -----------------------------------------------------------------------------

    def _sample_into(self, ws: _Workspace, b: int, logits: torch.Tensor) -> None:
        """Sample the current step for the first b cache rows and record it (all on device)."""
        step = ws.step
        rows = ws.row_ids[:b]
        steps = step.expand(b)
        token, log_prob = ws.sampler.sample(logits, ws.uniform[rows, steps], step)
        finished = ws.finished[:b]
        live = ~finished
        token = torch.where(finished, ws.pad, token)
        log_prob = torch.where(live, log_prob, 0.0)
        ws.out_tokens.index_put_((rows, steps), token)
        ws.out_log_probs.index_put_((rows, steps), log_prob)
        ws.out_mask.index_put_((rows, steps), live)
        column = (ws.prompt_width + step).expand(b, 1)
        ws.valid[:b].scatter_(1, column, live[:, None])
        window = torch.cat([ws.window[:b, 1:], token[:, None]], dim=1)
        ws.window[:b] = window
        now = finished | ws.sampler.stop_hits(window, step)
        ws.finished[:b] = now
        ws.stopped.index_put_((rows,), now)
        ws.tokens[:b] = token

    def decode_step(self, ws: _Workspace, b: int, attend: int) -> None:
        """One static-shape step: feed the last tokens of b rows against `attend` cache
        columns, sample the next ones, advance the step. No host synchronisation."""
        column = (ws.prompt_width + ws.step - 1).view(1)  # where the fed token's K/V go
        caches = [(ws.k[i, :b, :, :attend], ws.v[i, :b, :, :attend]) for i in range(ws.k.shape[0])]
        logits = self.forward.decode(
            ws.tokens[:b], ws.positions[:b], column, caches, ws.valid[:b, :attend], ws.shared
        )
        self._sample_into(ws, b, logits)
        ws.positions[:b] += 1
        ws.step += 1

    def _run(self, ws: _Workspace, b: int, attend: int, *, wait_to_capture: bool = False) -> None:
        """decode_step, replayed from a CUDA graph on CUDA (captured on first use, unless a
        weight update's device work runs then and not `wait_to_capture`: capture_guard.py;
        the step has run eagerly, and a later use captures)."""
        key = _step_key(b, attend, ws.shared)
        ws.shapes.add(key)
        if not self.use_graphs:
            self.decode_step(ws, b, attend)
            return
        graph = ws.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        # The first run is a real step, eager on a side stream (it warms up the kernels the
        # capture records); the capture itself executes nothing.
        current = torch.cuda.current_stream(self.device)
        side = self._capture_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.decode_step(ws, b, attend)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with captures_now(self.device, wait=wait_to_capture) as now:
            if not now:  # an update is staging: the step ran above; capture at a later use
                return
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, pool=self._pool, stream=side, capture_error_mode=CAPTURE_ERROR_MODE
            ):
                self.decode_step(ws, b, attend)
        ws.graphs[key] = graph

    def _capture_stream(self) -> torch.cuda.Stream:
        """The stream this engine captures its graphs on (and runs their warm-up steps on),
        made once, on its device. Not torch's default capture stream: that one is made on the
        current device (cuda:0 on the engine thread of a server on cuda:1, where nothing of the
        step would be captured), and from the pool of low-priority streams, which hands its 32
        streams out in turn, so a weight stager's copy stream can be the same stream, and its
        copies, launched on another thread during a capture, would be recorded into the graph.
        Nothing else here takes a stream of the high-priority pool."""
        if self._graph_stream is None:
            self._graph_stream = torch.cuda.Stream(self.device, priority=-1)
        return self._graph_stream

    def _compact(self, ws: _Workspace, b: int, smaller: int, columns: int) -> int:
        """Move the live rows of the first b to the front of a `smaller` bucket; fill the rest
        with finished rows that write to the junk output row. Only the first `columns` cache
        columns (those written so far, the step's attention width) are moved."""
        keep = (~ws.finished[:b]).nonzero().squeeze(1)
        live = keep.numel()
        ws.shared = None  # the live rows are no longer whole groups
        order = torch.cat([keep, keep.new_zeros(smaller - live)])  # (smaller,)
        for buffer in (ws.tokens, ws.positions, ws.valid, ws.window, ws.finished, ws.row_ids):
            buffer[:smaller] = buffer[order]
        ws.finished[live:smaller] = True
        ws.row_ids[live:smaller] = ws.rows
        for layer in range(ws.k.shape[0]):  # one layer at a time bounds the temporary
            ws.k[layer, :smaller, :, :columns] = ws.k[layer, order, :, :columns]
            ws.v[layer, :smaller, :, :columns] = ws.v[layer, order, :, :columns]
        return smaller
