"""Where the engine's decode step and a scoring forward spend their time, in one short run.

A decode step of the issue's case costs ~6 ms on an H100 where the bytes it must move take ~2
ms, and the engine's speed followed memory bandwidth from H100 to H200: something moves about
three times the bytes it should. This script prints where the time goes, in about a minute of
device time. The model is bench_gpu.py's (a random Qwen2-0.5B-shaped model of
bench_generation.py, no download: by default the issue's, vocab 32,000 and tied; --model 0.5b:
the 151,936 vocabulary of the figures before 2026-11-27; --quick: its tiny Llama). Parts, in
order, each skipped once --budget-s is spent (a failing part prints its error and the run goes
on, exit status 1):

1. Copy ceiling: one device-to-device copy, the GB/s a memory-bound step can hope for.
2. Decode step: the engine (engine_for, as a server builds it: compiled layers and CUDA graphs
   on CUDA) warmed up for the case (64 prompts x 8 = 512 rows, 128-token prompts, 256 new
   tokens, temperature 1) at its top batch bucket only, then, at the first and the widest
   attention width the request steps through: median ms of the engine's captured graph, of
   the eager step (compiled layers, no graph), of Forward.decode alone (eager and as a graph
   captured here); the bytes the step must move (the floor: weights read, live KV at the
   width, logits written and read; beside it a float32 (rows, vocab) written and read, what a
   sampler that materialises probabilities adds) and the GB/s the floor implies. Then the
   decode attention variants (attention.py: pick_decode_attention) at each of those widths on
   layer 0's cache as the request left it, in ms per call, with the GB/s of their KV reads,
   the fastest here and the engine's choice (timed by its warm-up at the widest width); with
   them the shared-prefix variants (server/generation/shared_prefix.py: each group's prompt
   columns read once), and before them the whole step with each of those against the plain
   step (what ROLLSERVE_SHARED_PREFIX_ATTENTION, off by default, would give the request).
3. Sampler alone: Sampler.sample of the workspace on random (rows, vocab) logits, eager and as
   a graph, and its share of the graph step.
   Decode kernels: torch.profiler over a few eager steps (and graph replays at the widest
   width): the top kernels by device time, the same grouped by kind (name patterns), and the
   record_function ranges this script puts around forward.decode and sampler.sample (server/
   is not touched: the pieces are called here one by one). Graphs are all captured before.
4. Scoring: action_log_probs of one forward batch (8 prompts x 8 samples, 128 + 256 columns,
   engine path) against the decoder body alone (Forward.hidden_states), with the TFLOP/s of
   their matmuls, and the top kernels of one call.
   New prefill shapes: the first prefill of a prompt count the process never ran against its
   repeat, with SDPA's own pick and (CUDA) without its cuDNN backend (the default): what a request
   pays for a new shape, and whether the attention's per-shape plans are that cost.
5. Summary: the lines to read first.
6. Scoring body, C++ wrapper: the decoder body with Inductor's C++ wrapper for its compiled
   calls (ROLLSERVE_ENGINE_CPP_WRAPPER=1) against the default, after the summary: its C++
   builds take tens of seconds, and a bound that ends the run inside them loses nothing else.

Times are CUDA-event medians on CUDA (launch gaps included: an eager step's time is what it
really costs), wall-clock medians elsewhere; on the CPU the kernel tables list operators by
self CPU time.

    python bench/profile_gpu.py                          # one H100/H200: about a minute
    python bench/profile_gpu.py --device cpu --quick     # the same tables on the CPU (< 1 min)
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generation import (  # noqa: E402
    GPU_BENCH_MODEL,
    QWEN2_05B_VOCAB,
    build_model,
    grouped_prompts,
)
from bench_gpu import Case, scoring_rows, scoring_tflop, timed  # noqa: E402
from rollserve.server.experience.generation import SamplingParams, left_pad  # noqa: E402
from rollserve.server.experience.scoring import (  # noqa: E402
    action_log_probs,
    position_ids_from_mask,
)
from rollserve.server.generation import Engine, engine_for, scoring_forward  # noqa: E402
from rollserve.server.generation import model as generation_model  # noqa: E402
from rollserve.server.generation.attention import (  # noqa: E402
    DEFAULT_PREFILL_ATTENTION,
    PREFILL_ATTENTION,
    PrefillBackends,
    additive_mask,
    decode_attention_variants,
    pick_decode_attention,
)
from rollserve.server.generation.compiling import (  # noqa: E402
    CPP_WRAPPER_ENV,
    cpp_wrapper_missing,
)
from rollserve.server.generation.model import Forward  # noqa: E402
from rollserve.server.generation.runner import (  # noqa: E402
    _step_key,
    attention_width,
    batch_bucket,
)
from rollserve.server.generation.shared_prefix import (  # noqa: E402
    SharedPrefix,
    shared_prefix_variants,
)

GB = 1e9
# Section headers, in print order; tests/test_profile_script.py looks for each of them.
SETUP, COPY, DECODE, SAMPLER = "## Setup", "## Copy ceiling", "## Decode step", "## Sampler alone"
DECODE_KERNELS, SCORING, SCORING_KERNELS = "## Decode kernels", "## Scoring", "## Scoring kernels"
NEW_SHAPES, SUMMARY = "## New prefill shapes", "## Summary"
CPP_WRAPPER = "## Scoring body, C++ wrapper"
SECTIONS = (SETUP, COPY, DECODE, SAMPLER, DECODE_KERNELS, SCORING, SCORING_KERNELS, NEW_SHAPES,
            SUMMARY, CPP_WRAPPER)  # fmt: skip
# Distinct prompt counts no earlier part prefills (the decode case runs 64, scoring 8), three per
# attention variant: each is a shape the process has not seen.
NEW_PROMPT_COUNTS = (3, 5, 7, 11, 13, 17)
# Kernel kinds by name pattern, first match wins: a coarse split of the device time that
# survives kernel renames across torch and CUDA versions better than kernel names do.
KERNEL_KINDS = (
    ("attention", r"fmha|flash|attention|efficient|sdpa"),
    ("matmul", r"gemm|gemv|cutlass|cublas|xmma|nvjet|sm\d\d_|matmul|aten::(mm|addmm|bmm|linear)"),
    ("compiled (triton)", r"triton"),
    ("scan/sort (sampler)", r"cumsum|scan|sort|topk|searchsorted|radix"),
    ("copy/index", r"copy|index|scatter|gather|cat|memcpy|memset|fill|where|clone"),
    ("reduce", r"reduce|sum|mean|amax|max|logsumexp|softmax"),
    ("elementwise", r"elementwise|vectorized|aten::"),
)


# ---- timing -----------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Median milliseconds of a callable over reps calls after one warm call: CUDA events
    around each call on CUDA (what the call occupied the stream for, launch gaps included),
    the wall clock elsewhere. `before` runs ahead of each call, outside the measured span."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.device = device
        self.reps = reps

    def median_ms(self, fn: Callable[[], object], before: Callable[[], object] | None = None):
        prepare = before or (lambda: None)
        prepare()
        fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(self.reps):
                prepare()
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        pairs = []
        for _ in range(self.reps):
            prepare()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        sync(self.device)
        return statistics.median(start.elapsed_time(end) for start, end in pairs)

    def host_ms(self, fn: Callable[[], object]) -> float:
        """Median wall ms the host takes to issue fn from an idle device: on CUDA until fn
        returns, not until its kernels end (its own syncs at its start return at once)."""
        times = []
        for _ in range(self.reps):
            sync(self.device)
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        sync(self.device)
        return statistics.median(times)


def as_graph(fn: Callable[[], object], device: torch.device) -> Callable[[], object] | None:
    """fn captured as a CUDA graph (its replay), after one run on a side stream as the engine
    does before its captures; None off CUDA. The graph keeps fn's outputs in its own pool."""
    if device.type != "cuda":
        return None
    current, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        fn()
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


class Budget:
    """The run's wall-clock budget: a part starts only while some is left."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()

    def spent(self) -> float:
        return time.monotonic() - self.start

    def allows(self, part: str) -> bool:
        if self.spent() < self.seconds:
            return True
        print(f"skipped {part}: over --budget-s {self.seconds:.0f} ({self.spent():.0f} s spent)")
        return False


# ---- printing ---------------------------------------------------------------------------------


def print_table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(flush=True)


def _event_us(event: object, kind: str) -> float:
    """An averaged event's microseconds: `self_device_time_total` and the like, under the
    name the running torch uses (older ones say cuda where newer ones say device)."""
    value = getattr(event, kind, None)
    if value is None:
        value = getattr(event, kind.replace("device", "cuda"), 0)
    return float(value or 0)


def _is_device_event(event: object) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def kernel_rows(prof: profile, on_cuda: bool, ranges: set[str]) -> list[tuple[str, int, float]]:
    """(name, calls, total us) of the kernels in a profile by device time (the CPU's operators
    by self CPU time where no kernel ran), the script's record_function ranges left out."""
    events = [
        e
        for e in prof.key_averages()
        if e.key not in ranges and not getattr(e, "is_user_annotation", False)
    ]
    if on_cuda:
        kernels = [
            (e.key, e.count, _event_us(e, "self_device_time_total"))
            for e in events
            if _is_device_event(e)
        ]
        if kernels:
            return sorted(kernels, key=lambda row: -row[2])
        print("(the profiler saw no device kernels: operators by self CPU time instead)")
    ops = [(e.key, e.count, float(e.self_cpu_time_total)) for e in events if e.count]
    return sorted(ops, key=lambda row: -row[2])


def print_kernels(rows: list[tuple[str, int, float]], calls: int, top: int) -> float:
    """The top kernels with their share of all kernels' time, then the kinds; returns the
    kernels' total ms per call (the device's busy time for one step or forward)."""
    total = sum(us for _, _, us in rows) or 1.0
    print_table(
        ["kernel", "launches", "total ms", "ms per call", "share"],
        [
            [name[:90], str(n), f"{us / 1e3:.3f}", f"{us / 1e3 / calls:.3f}", f"{us / total:.1%}"]
            for name, n, us in rows[:top]
        ],
    )
    kinds: dict[str, float] = {}
    for name, _, us in rows:
        kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, name, re.I)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + us
    ordered = sorted(kinds.items(), key=lambda item: -item[1])
    print_table(
        ["kind (name pattern)", "ms per call", "share"],
        [[kind, f"{us / 1e3 / calls:.3f}", f"{us / total:.1%}"] for kind, us in ordered],
    )
    return total / 1e3 / calls


def print_ranges(prof: profile, names: list[str], calls: int) -> None:
    """The script's record_function ranges per call: host ms (launches included), the device
    time of the kernels launched inside, and the device's span from the range's first kernel
    to its last (gaps included; CUDA only)."""
    rows = []
    for name in names:
        matches = [e for e in prof.key_averages() if e.key == name]
        host = [e for e in matches if not _is_device_event(e)]
        span = [e for e in matches if _is_device_event(e)]
        cpu_ms = sum(e.cpu_time_total for e in host) / 1e3 / calls
        kernels_ms = sum(_event_us(e, "device_time_total") for e in host) / 1e3 / calls
        span_ms = sum(_event_us(e, "device_time_total") for e in span) / 1e3 / calls
        rows.append([name, f"{cpu_ms:.3f}", f"{kernels_ms:.3f}", f"{span_ms:.3f}" if span else "-"])
    print_table(["range", "host ms", "kernels ms", "device span ms"], rows)


def profiled(fn: Callable[[], object], calls: int, device: torch.device) -> profile:
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    return prof


# ---- 1. setup and copy ceiling ----------------------------------------------------------------


@dataclass(frozen=True)
class Shapes:
    decode: Case
    scoring: Case  # one forward batch: its rows share prompts as a GRPO group's do


def shapes(quick: bool) -> Shapes:
    """The issue's case; --quick: two attention widths still (a 120-token prompt crosses the
    128-column quantum)."""
    if quick:
        return Shapes(Case("quick", 4, 2, 120, 16), Case("quick scoring", 2, 2, 120, 16))
    return Shapes(Case("64 prompts x 8", 64, 8, 128, 256), Case("scoring", 8, 8, 128, 256))


def copy_ceiling_gbs(device: torch.device, timer: Timer, quick: bool) -> float:
    """GB/s of a device-to-device copy (bytes read + written): what the memory delivers."""
    size = (64 << 20) if quick else (1 << 30)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = timer.median_ms(lambda: target.copy_(source))
    return 2 * size / (ms / 1e3) / GB


# ---- 2. decode --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepBytes:
    """What one decode step has to move at the least, in bytes."""

    weights: int  # every parameter read once; of the embedding only the fed tokens' rows
    kv: int  # K and V of every layer, the live width of every row, read once
    logits: int  # (rows, vocab) written by lm_head and read once by the sampler
    sampler_probs: int  # a float32 (rows, vocab) written and read once: probabilities

    @property
    def floor(self) -> int:
        return self.weights + self.kv + self.logits


def step_bytes(model: torch.nn.Module, engine: Engine, rows: int, attend: int) -> StepBytes:
    family, itemsize = engine.family, engine.dtype.itemsize
    embed = model.get_input_embeddings().weight
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = family.lm_head is not None and family.lm_head.weight.data_ptr() == embed.data_ptr()
    weights = (
        params if tied else params - embed.numel() * itemsize + rows * embed.shape[1] * itemsize
    )
    kv = 2 * len(family.layers) * rows * family.num_kv_heads * attend * family.head_dim * itemsize
    return StepBytes(weights, kv, 2 * rows * family.vocab * itemsize, 2 * rows * family.vocab * 4)


@dataclass
class Decode:
    """The engine's workspace in the middle of the case's request, and how to run its pieces."""

    engine: Engine
    ws: object
    rows: int  # the batch bucket the steps run at
    widths: dict[int, int]  # attention width -> the first step that reads it
    first_positions: torch.Tensor  # (rows,) the position ids step 1 feeds
    # Groups of consecutive rows whose prompt columns hold the same K/V (the request's GRPO
    # groups, prefilled once and copied): what the shared-prefix attention variants read once.
    shared: SharedPrefix | None = None

    def at(self, attend: int) -> Callable[[], None]:
        """Puts the step counter and positions back to the width's first step (every timed
        call advances them; the output tables must stay inside the layout)."""
        step = self.widths[attend]
        positions = self.first_positions + step - 1

        def reset() -> None:
            self.ws.step.fill_(step)
            self.ws.positions[: self.rows].copy_(positions)

        return reset

    @property
    def measured_widths(self) -> list[int]:
        """The first and the widest width (one when the request never leaves the first)."""
        return sorted({min(self.widths), max(self.widths)})

    def step(self, attend: int) -> Callable[[], None]:
        return lambda: self.engine.decode_step(self.ws, self.rows, attend)

    def forward(self, attend: int) -> Callable[[], torch.Tensor]:
        """Forward.decode as decode_step calls it (cache views of the width, the step's column)."""
        ws, b = self.ws, self.rows

        def run() -> torch.Tensor:
            column = (ws.prompt_width + ws.step - 1).view(1)
            caches = [(ws.k[i, :b, :, :attend], ws.v[i, :b, :, :attend]) for i in range(len(ws.k))]
            return self.engine.forward.decode(
                ws.tokens[:b], ws.positions[:b], column, caches, ws.valid[:b, :attend]
            )

        return run

    def uniform(self) -> torch.Tensor:
        """Each row's random number of the current step, as _sample_into gathers it."""
        return self.ws.uniform[self.ws.row_ids[: self.rows], self.ws.step.expand(self.rows)]

    def sample(self, logits: torch.Tensor, uniform: torch.Tensor) -> Callable[[], object]:
        return lambda: self.ws.sampler.sample(logits, uniform, self.ws.step)


def start_decode(model: torch.nn.Module, case: Case, device: torch.device) -> Decode:
    """engine_for's engine, warmed up (compile + capture) for the case's top bucket only (the
    buckets below it are what finished rows move to; none finish here: no EOS), then the
    request's prompts prefilled and step 0 sampled, as Engine.generate starts a batch."""
    params = SamplingParams(max_new_tokens=case.new_tokens, temperature=1.0)
    engine = engine_for(model, "rollserve")
    started = time.perf_counter()
    engine.warm_up(params, case.rows, case.prompt_len, pad_token_id=0, budget_s=0.0)
    warm_s = time.perf_counter() - started
    vocab = engine.family.vocab
    prompts = grouped_prompts(case.rows, case.samples, case.prompt_len, case.prompt_len, vocab, 1)
    ids, mask = left_pad(prompts, 0, device)
    g = torch.Generator(device=device).manual_seed(0)
    uniform = torch.rand((case.rows, case.new_tokens), generator=g, dtype=torch.float64,
                         device=device)  # fmt: skip
    ws = engine.workspace(case.rows, case.prompt_len, params, 0)
    rows = engine.start(ws, ids, mask, uniform, case.new_tokens, share=True)
    ws.shared = None  # the plain step, even under ROLLSERVE_SHARED_PREFIX_ATTENTION: the
    # shared-prefix one is timed beside it (shared_step_timings)
    widths: dict[int, int] = {}
    for step in range(1, case.new_tokens):
        widths.setdefault(attention_width(case.prompt_len + step, ws.width), step)
    print(
        f"engine: warm-up of bucket {batch_bucket(case.rows, ws.rows)} in {warm_s:.1f} s; "
        f"layout {ws.rows} rows x {ws.width} columns, KV capacity {engine.capacity_tokens} "
        f"tokens, compiled {engine.compiled}, fused projections "
        f"{engine.forward.fused_projections}, CUDA graphs {engine.use_graphs} "
        f"({len(ws.graphs)} captured); attention widths (first step) {widths}; decode "
        f"attention {engine.decode_attention} {_variant_ms(engine.decode_attention_ms)}\n",
        flush=True,
    )
    shared = SharedPrefix.of_layout(case.samples, case.prompt_len)
    if shared is not None and rows % shared.samples:
        shared = None  # filler rows would break the groups
    return Decode(engine, ws, rows, widths, ws.positions[:rows].clone(), shared)


def decode_timings(
    model: torch.nn.Module, decode: Decode, timer: Timer, figures: dict[str, float]
) -> None:
    """Per width (the first and the widest): the step as graph and eager, the forward alone,
    what the step must move and the GB/s its time implies."""
    device = decode.engine.device
    rows = []
    for attend in decode.measured_widths:
        reset = decode.at(attend)
        graph = decode.ws.graphs.get((decode.rows, attend))
        graph_ms = timer.median_ms(graph.replay, reset) if graph is not None else None
        eager_ms = timer.median_ms(decode.step(attend), reset)
        forward_ms = timer.median_ms(decode.forward(attend), reset)
        forward_graph = as_graph(decode.forward(attend), device)
        forward_graph_ms = timer.median_ms(forward_graph, reset) if forward_graph else None
        del forward_graph
        step_ms = graph_ms if graph_ms is not None else eager_ms
        need = step_bytes(model, decode.engine, decode.rows, attend)
        figures[f"step_ms@{attend}"] = step_ms
        figures[f"eager_ms@{attend}"] = eager_ms
        figures[f"forward_ms@{attend}"] = forward_graph_ms or forward_ms
        figures[f"floor_gb@{attend}"] = need.floor / GB
        figures[f"implied_gbs@{attend}"] = need.floor / GB / (step_ms / 1e3)
        rows.append([
            str(attend), _ms(graph_ms), f"{eager_ms:.3f}", _ms(forward_graph_ms),
            f"{forward_ms:.3f}", f"{need.weights / GB:.3g}", f"{need.kv / GB:.3g}",
            f"{need.logits / GB:.3g}", f"{need.floor / GB:.3g}",
            f"{need.floor / GB / (step_ms / 1e3):.3g}",
            f"{need.sampler_probs / GB:.3g}",
        ])  # fmt: skip
    print_table(
        ["width", "graph step ms", "eager step ms", "forward graph ms", "forward eager ms",
         "weights GB", "KV GB", "logits GB", "floor GB", "floor GB/s at step",
         "+ f32 probs GB"],
        rows,
    )  # fmt: skip


def shared_step_timings(decode: Decode, timer: Timer, figures: dict[str, float]) -> None:
    """The whole decode step with each shared-prefix attention (shared_prefix.py: a group's
    prompt columns read once) against the plain step, at the measured widths: the engine's
    graph replay on CUDA (captured here, keyed apart from the plain graphs), its eager step
    elsewhere. What ROLLSERVE_SHARED_PREFIX_ATTENTION would give this request's steps."""
    engine, ws = decode.engine, decode.ws
    variants = list(shared_prefix_variants(decode.shared, engine.device, engine.compiled))
    before = engine.forward.shared_attention_variant
    rows = []
    try:
        for attend in decode.measured_widths:
            reset = decode.at(attend)
            plain = figures[f"step_ms@{attend}"]
            cells = [f"{plain:.3f}"]
            for name in variants:
                engine.forward.shared_attention_variant = name
                ws.shared = decode.shared
                reset()
                # A graph is keyed by the step's shape, not by the variant it recorded (the
                # forward reads the variant only while capturing): the last variant's graph
                # goes, or this one would replay it (the H200's 12:59 rows did).
                key = _step_key(decode.rows, attend, decode.shared)
                ws.graphs.pop(key, None)
                engine._run(ws, decode.rows, attend, wait_to_capture=True)  # eager step, capture
                graph = ws.graphs.get(key)
                ms = timer.median_ms(graph.replay if graph else decode.step(attend), reset)
                figures[f"shared_step_ms@{attend}:{name}"] = ms
                cells.append(f"{ms:.3f} ({plain / ms:.2f}x)")
            rows.append([str(attend)] + cells)
    finally:
        ws.shared = None
        engine.forward.shared_attention_variant = before
    print(
        f"The step with a shared-prefix attention ({decode.shared.samples} rows per group "
        f"read their first {decode.shared.prefix} columns once; x: plain / shared):\n"
    )
    print_table(["width", "plain step ms"] + [f"{name} step ms" for name in variants], rows)


def attention_variants(decode: Decode, reps: int, figures: dict[str, float]) -> None:
    """pick_decode_attention per width on layer 0's K/V views of the workspace (the request's
    prefilled cache and its valid columns as the mask, random q): ms per call of each variant
    (on CUDA inside a CUDA graph, as the engine replays it), the GB/s of its K and V reads.
    With the request's groups, also the shared-prefix variants (shared_prefix.py: a group's
    prompt columns read once; not in the engine yet), whose GB/s count the columns they read."""
    engine, ws, b = decode.engine, decode.ws, decode.rows
    family = engine.family
    g = torch.Generator(device=engine.device).manual_seed(2)
    q = torch.randn((b, family.num_heads, family.head_dim), generator=g, device=engine.device)
    q = q.to(engine.dtype)
    variants = decode_attention_variants(engine.device, engine.compiled)
    if decode.shared is not None:
        variants |= shared_prefix_variants(decode.shared, engine.device, engine.compiled)
    rows, names = [], []
    for attend in decode.measured_widths:
        k, v = ws.k[0, :b, :, :attend], ws.v[0, :b, :, :attend]
        mask = additive_mask(ws.valid[:b, :attend], engine.dtype)
        fastest, timings = pick_decode_attention(q, k, v, mask, family.scaling, reps,
                                                 variants=variants)  # fmt: skip
        names = list(timings)
        column_bytes = 2 * k.shape[1] * k.shape[3] * k.element_size()  # K and V, per column
        full_gb = b * attend * column_bytes / GB
        shared_gb = (decode.shared.columns_read(b, attend) * column_bytes / GB
                     if decode.shared is not None else full_gb)  # fmt: skip
        figures.update({f"attention_ms@{attend}:{n}": ms for n, ms in timings.items()})
        cells = [_variant_cell(ms, shared_gb if n.endswith("_shared") else full_gb)
                 for n, ms in timings.items()]  # fmt: skip
        rows.append([str(attend)] + cells + [fastest, engine.decode_attention])
    print_table(
        ["width"] + [f"{n} ms (KV GB/s)" for n in names] + ["fastest here", "engine's choice"],
        rows,
    )
    print(f"(engine's warm-up timings, top bucket at the widest width: "
          f"{_variant_ms(engine.decode_attention_ms)})\n", flush=True)  # fmt: skip


def _variant_cell(ms: float, kv_gb: float) -> str:
    return "failed" if math.isnan(ms) else f"{ms:.4f} ({kv_gb / (ms / 1e3):.0f})"


def _variant_ms(timings: dict[str, float]) -> str:
    """A warm-up's timings in a line; "(not timed)" when it timed none (CPU, forced)."""
    if not timings:
        return "(not timed)"
    return ", ".join(
        f"{name} failed" if math.isnan(ms) else f"{name} {ms:.4f} ms"
        for name, ms in timings.items()
    )


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def decode_profiles(decode: Decode, steps: int, top: int) -> None:
    """torch.profiler per width: eager steps (kernel table and kinds) and the pieces under the
    script's ranges; at the widest width the engine's graph replays too."""
    for attend in decode.measured_widths:
        _profile_eager(decode, attend, steps, top)
    widest = max(decode.widths)
    graph = decode.ws.graphs.get((decode.rows, widest))
    if graph is None:
        print("(no captured graph to profile: no CUDA)\n")
        return
    reset = decode.at(widest)

    def replay() -> None:
        reset()
        graph.replay()

    print(f"### width {widest}: top {top} kernels of {steps} graph replays\n")
    device = decode.engine.device
    print_kernels(kernel_rows(profiled(replay, steps, device), True, set()), steps, top)


def _profile_eager(decode: Decode, attend: int, steps: int, top: int) -> None:
    device = decode.engine.device
    reset, step, forward = decode.at(attend), decode.step(attend), decode.forward(attend)

    def eager_step() -> None:
        reset()
        with record_function("decode_step"):
            step()

    def pieces() -> None:
        reset()
        uniform = decode.uniform()
        with record_function("forward.decode"):
            logits = forward()
        with record_function("sampler.sample"):
            decode.sample(logits, uniform)()

    print(f"### width {attend}: top {top} kernels of {steps} eager decode steps\n")
    prof = profiled(eager_step, steps, device)
    print_kernels(kernel_rows(prof, device.type == "cuda", {"decode_step"}), steps, top)
    print(f"### width {attend}: ranges of {steps} eager steps called piece by piece\n")
    print_ranges(profiled(pieces, steps, device), ["forward.decode", "sampler.sample"], steps)


# ---- 3. sampler -------------------------------------------------------------------------------


def sampler_timings(decode: Decode, timer: Timer, figures: dict[str, float]) -> None:
    """Sampler.sample of the workspace on random logits of the step's shape."""
    device, engine = decode.engine.device, decode.engine
    g = torch.Generator(device=device).manual_seed(1)
    logits = torch.randn((decode.rows, engine.family.vocab), generator=g, device=device)
    logits = (logits * 3).to(engine.dtype)
    sample = decode.sample(logits, decode.uniform())
    eager_ms = timer.median_ms(sample)
    graph = as_graph(sample, device)
    graph_ms = timer.median_ms(graph) if graph is not None else None
    del graph
    ms = graph_ms if graph_ms is not None else eager_ms
    figures["sampler_ms"] = ms
    rows = []
    for attend in decode.measured_widths:
        step_ms = figures.get(f"step_ms@{attend}")
        share = f"{ms / step_ms:.1%}" if step_ms else "n/a"
        rows.append([f"({decode.rows}, {engine.family.vocab})", str(attend), _ms(graph_ms),
                     f"{eager_ms:.3f}", _ms(step_ms), share])  # fmt: skip
    print_table(["logits", "width", "graph ms", "eager ms", "step ms", "share of the step"], rows)


# ---- 4. scoring -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scoring:
    """One forward batch of the scoring case, whole and its decoder body alone."""

    whole: Callable[[], object]  # action_log_probs on the engine path
    body: Callable[[], object]  # Forward.hidden_states of the same rows
    body_unshared: Callable[[], object]  # the same, each row's prompt its own (not run once)
    body_on: Callable[[Forward], object]  # `body` run by another forward of the same model
    body_tflop: float  # of the body's matmuls (attention's left out)
    head_tflop: float  # of lm_head over every action position
    forward: Forward  # the engine's forward that `body` runs (its prefill_backend is read per call)


def scoring_calls(model: torch.nn.Module, case: Case) -> Scoring:
    device = model.get_input_embeddings().weight.device
    sequences, mask = scoring_rows(case, model.config.vocab_size, device)
    forward = scoring_forward(model, "rollserve")
    assert forward is not None
    positions = position_ids_from_mask(mask)
    actions = case.new_tokens

    def whole() -> object:
        return action_log_probs(model, sequences, mask, actions, forward_batch_size=case.rows,
                                temperature=1.0, path="rollserve")  # fmt: skip

    def body() -> object:
        return forward.hidden_states(sequences, mask, positions, case.prompt_len)

    def body_unshared() -> object:
        return forward.hidden_states(sequences, mask, positions)

    def body_on(other: Forward) -> object:
        return other.hidden_states(sequences, mask, positions, case.prompt_len)

    return Scoring(whole, body, body_unshared, body_on, *scoring_tflop(model, case), forward)


def scoring_timings(scoring: Scoring, timer: Timer, figures: dict[str, float]) -> None:
    whole_ms, body_ms = timer.median_ms(scoring.whole), timer.median_ms(scoring.body)
    head_ms = whole_ms - body_ms
    body_tflop, head_tflop = scoring.body_tflop, scoring.head_tflop
    figures.update(scoring_whole_ms=whole_ms, scoring_body_ms=body_ms)
    print_table(
        ["part", "ms", "share", "TFLOP (matmuls)", "TFLOP/s"],
        [
            ["action_log_probs, whole", f"{whole_ms:.2f}", "100%",
             f"{body_tflop + head_tflop:.3g}", _rate(body_tflop + head_tflop, whole_ms)],
            ["decoder body (Forward.hidden_states)", f"{body_ms:.2f}", f"{body_ms / whole_ms:.0%}",
             f"{body_tflop:.3g}", _rate(body_tflop, body_ms)],
            ["the rest: chunked lm_head + log-probs", f"{head_ms:.2f}", f"{head_ms / whole_ms:.0%}",
             f"{head_tflop:.3g}", _rate(head_tflop, head_ms)],
        ],
    )  # fmt: skip
    print("(bench_gpu.py scores 8 such forward batches per model: x8 for its figure)\n")
    body_by_setting(scoring, timer, body_ms)  # off CUDA the settings are ignored: equal


@contextmanager
def prefill_setting(forward: Forward, backends: PrefillBackends) -> Iterator[None]:
    """`forward` runs its prefill and scoring attention with `backends` (one of
    PREFILL_ATTENTION's settings) inside, its own setting again after."""
    configured = forward.prefill_backend
    forward.prefill_backend = backends
    try:
        yield
    finally:
        forward.prefill_backend = configured


def body_by_setting(scoring: Scoring, timer: Timer, default_ms: float) -> None:
    """The decoder body under each other ROLLSERVE_PREFILL_ATTENTION setting, at this steady
    shape (the warm call builds any per-shape plan): what the default costs or saves once
    shapes repeat (its reason is the new shapes' cost, "New prefill shapes" below); and with
    the forward's call structure changed. "host ms": the host's time to issue one body from an
    idle device (Timer.host_ms); near "body ms", the body is bound by the host (or by CUDA's
    launch queue, which blocks the host once full), well under it, by the device."""
    columns = ["setting", "body ms", "host ms", "vs the default"]
    rows = [[f"{DEFAULT_PREFILL_ATTENTION} (the default)", f"{default_ms:.2f}",
             f"{timer.host_ms(scoring.body):.2f}", "1.00x"]]  # fmt: skip

    def add(name: str, body: Callable[[], object]) -> None:
        ms = timer.median_ms(body)
        rows.append([name, f"{ms:.2f}", f"{timer.host_ms(body):.2f}", f"{ms / default_ms:.2f}x"])

    for name, backends in PREFILL_ATTENTION.items():
        if name == DEFAULT_PREFILL_ATTENTION:
            continue
        try:
            with prefill_setting(scoring.forward, backends):
                add(name, scoring.body)
        except RuntimeError as error:  # a backend that does not take these inputs
            rows.append([name, f"failed: {str(error).splitlines()[0][:80]}", "-", "-"])
    # The call structure before 5d3ce2b: a compiled MLP call per MLP_CHUNK_TOKENS tokens (its
    # first run here compiles, in the timer's warm call): what one call a layer saves the host.
    with mlp_call_chunks(1):
        add("efficient, a call per MLP chunk", scoring.body)
    # A group's prompt run once saves ~30 % of the matmuls here, for a gather and two K/V
    # concatenations a layer: what that buys on this device.
    add("efficient, each row's prompt its own", scoring.body_unshared)
    print("Decoder body by ROLLSERVE_PREFILL_ATTENTION (steady shape, medians):\n")
    print_table(columns, rows)


def cpp_wrapper_body(scoring: Scoring, timer: Timer) -> None:
    """The scoring case's decoder body with Inductor's C++ wrapper for its compiled calls
    (ROLLSERVE_ENGINE_CPP_WRAPPER=1) against the default's Python wrapper: what launching
    their kernels without Python saves the host. Its first run builds them (a C++ compile
    each, tens of seconds, in the timer's warm call: the last part of the run, so that a
    budget it overruns loses nothing else); without a C++ compiler they fall back to eager,
    which the row says rather than time."""
    columns = ["wrapper", "body ms", "host ms", "vs the default"]
    default_ms = timer.median_ms(scoring.body)
    rows = [["Python (the default)", f"{default_ms:.2f}", f"{timer.host_ms(scoring.body):.2f}",
             "1.00x"]]  # fmt: skip
    missing = cpp_wrapper_missing(scoring.forward.family.embed.weight.device.type)
    if not scoring.forward.compiled:
        rows.append(["C++", "- (the forward runs eager here)", "-", "-"])
    elif missing is not None:
        rows.append(["C++", f"- (not built: {missing})", "-", "-"])
    else:
        cpp = cpp_wrapper_forward(scoring.forward)

        def body() -> object:
            return scoring.body_on(cpp)

        ms = timer.median_ms(body)
        if cpp.runs_compiled:
            rows.append(
                ["C++", f"{ms:.2f}", f"{timer.host_ms(body):.2f}", f"{ms / default_ms:.2f}x"]
            )
        else:
            rows.append(["C++", "failed: fell back to eager (the log says why)", "-", "-"])
    print_table(columns, rows)


def cpp_wrapper_forward(forward: Forward) -> Forward:
    """A compiled forward over `forward`'s model with ROLLSERVE_ENGINE_CPP_WRAPPER=1 (read when
    a Forward is made): Inductor's C++ wrapper for its full-sequence functions."""
    with mock.patch.dict(os.environ, {CPP_WRAPPER_ENV: "1"}):  # the process's own after
        return Forward(forward.family, forward.rope, compiled=True,
                       fused=forward.fused_projections > 0)  # fmt: skip


@contextmanager
def mlp_call_chunks(chunks: int) -> Iterator[None]:
    """The engine's full-sequence forward runs `chunks` MLP chunks per compiled call inside
    (model.MLP_CALL_CHUNKS), its own number again after."""
    configured = generation_model.MLP_CALL_CHUNKS
    generation_model.MLP_CALL_CHUNKS = chunks
    try:
        yield
    finally:
        generation_model.MLP_CALL_CHUNKS = configured


def scoring_kernels(scoring: Scoring, device: torch.device, top: int) -> None:
    rows = kernel_rows(profiled(scoring.whole, 1, device), device.type == "cuda", set())
    print_kernels(rows, 1, top)


def _rate(tflop: float, ms: float) -> str:
    return f"{tflop / (ms / 1e3):.3g}" if ms > 0 else "n/a"


# ---- 4b. new prefill shapes ---------------------------------------------------------------------


def new_shape_costs(model: torch.nn.Module, case: Case, device: torch.device,
                    figures: dict[str, float]) -> None:  # fmt: skip
    """The first prefill of a prompt count the process has not run against its repeat, per
    attention variant: what a request pays for a shape its server never saw (the first request
    after SERVING cost 1.45x a steady one on the H100). SDPA's cuDNN backend builds a plan per
    shape; its efficient backend (CUDA only) has none; the compiled layer functions take any
    token count (dynamic shapes), so the difference is the attention's."""
    forward = scoring_forward(model, "rollserve")
    assert forward is not None
    variants: list[tuple[str, PrefillBackends]] = [("sdpa (its pick)", PREFILL_ATTENTION["sdpa"])]
    if device.type == "cuda":
        variants.append(("efficient (no cuDNN)", PREFILL_ATTENTION["efficient"]))
    counts, rows = iter(NEW_PROMPT_COUNTS), []
    for name, backend in variants:
        extra = []
        for _ in range(len(NEW_PROMPT_COUNTS) // 2):
            prompts = next(counts)
            ids = torch.randint(3, model.config.vocab_size, (prompts, case.prompt_len),
                                device=device)  # fmt: skip
            valid = torch.ones_like(ids, dtype=torch.bool)
            positions = torch.arange(case.prompt_len, device=device).expand_as(ids)

            def prefill(ids=ids, valid=valid, positions=positions) -> object:
                return forward.prefill(ids, valid, positions, None)

            try:
                with prefill_setting(forward, backend):
                    first, again = (1e3 * timed(prefill, device.type) for _ in range(2))
            except RuntimeError as error:  # a backend that does not take these inputs
                rows.append([name, str(prompts), f"failed: {str(error).splitlines()[0][:80]}",
                             "-", "-"])  # fmt: skip
                continue
            extra.append(first - again)
            rows.append([name, str(prompts), f"{first:.2f}", f"{again:.2f}",
                         f"{first - again:.2f}"])  # fmt: skip
        if extra:
            figures[f"new_shape_ms:{name}"] = statistics.median(extra)
    print_table(["attention", "prompts", "first ms", "repeat ms", "first - repeat ms"], rows)


# ---- 5. summary and main ----------------------------------------------------------------------


def print_summary(figures: dict[str, float], copy_gbs: float | None) -> None:
    print(SUMMARY + "\n")
    if copy_gbs:
        print(f"copy ceiling {copy_gbs:.0f} GB/s (read + written)")
    sampler_ms = figures.get("sampler_ms")
    for key in sorted((k for k in figures if k.startswith("step_ms@")), key=_width):
        attend = key.split("@")[1]
        step_ms, floor_gb = figures[key], figures[f"floor_gb@{attend}"]
        forward_ms = figures[f"forward_ms@{attend}"]
        line = (
            f"width {attend}: step {step_ms:.3f} ms (eager {figures[f'eager_ms@{attend}']:.3f}), "
            f"floor {floor_gb:.3g} GB -> {figures[f'implied_gbs@{attend}']:.3g} GB/s"
        )
        if copy_gbs:
            line += f" (at the copy ceiling: {floor_gb / copy_gbs * 1e3:.3f} ms)"
        line += f"; forward {forward_ms:.3f} ms ({forward_ms / step_ms:.0%})"
        if sampler_ms is not None:
            line += (
                f", sampler {sampler_ms:.3f} ms, rest {step_ms - forward_ms - sampler_ms:.3f} ms"
            )
        print(line)
    attention: dict[str, dict[str, float]] = {}
    for key, ms in figures.items():
        if key.startswith("attention_ms@"):
            width, name = key.removeprefix("attention_ms@").split(":")
            attention.setdefault(width, {})[name] = ms
    for width, timings in sorted(attention.items(), key=lambda item: int(item[0])):
        print(f"width {width}: decode attention per call {_variant_ms(timings)}")
    if "scoring_whole_ms" in figures:
        whole, body = figures["scoring_whole_ms"], figures["scoring_body_ms"]
        print(f"scoring one forward batch: {whole:.2f} ms, body {body:.2f} ms ({body / whole:.0%})")
    shapes_ms = {k.split(":", 1)[1]: v for k, v in figures.items() if k.startswith("new_shape_ms:")}
    if shapes_ms:
        print("a new prefill shape, its first call over its repeat (median): "
              + ", ".join(f"{name} +{ms:.2f} ms" for name, ms in shapes_ms.items()))  # fmt: skip
    print("(nominal: H100 SXM 3.35 TB/s, ~990 TFLOP/s bf16 dense; H200 4.8 TB/s)", flush=True)


def _width(key: str) -> int:
    return int(key.split("@")[1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quick", action="store_true", help="the tiny model and case (CPU)")
    parser.add_argument(
        "--model", default=GPU_BENCH_MODEL, choices=sorted(QWEN2_05B_VOCAB),
        help="the Qwen2-0.5B shape by vocabulary (bench_generation.QWEN2_05B_VOCAB)",
    )  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=50.0, help="no part starts after it")
    parser.add_argument("--reps", type=int, default=0, help="timed calls per median (0: 20, 5)")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25, help="kernels per decode table")
    parser.add_argument("--scoring-top", type=int, default=15)
    args = parser.parse_args(argv)
    args.reps = args.reps or (5 if args.quick else 20)
    return args


class Parts:
    """Runs the parts in order: none starts once the budget is spent, and a failing one prints
    its error and the run goes on (its name is kept for the exit status)."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.failed: list[str] = []

    def run(self, name: str, fn: Callable[[], object]) -> object:
        if not self.budget.allows(name):
            return None
        try:
            return fn()
        except Exception:  # noqa: BLE001 - one failing part must not hide the others' figures
            traceback.print_exc()
            print(f"FAILED {name}\n", flush=True)
            self.failed.append(name)
            return None


def header(title: str, detail: str = "") -> None:
    print(f"{title} ({detail})\n" if detail else f"{title}\n", flush=True)


def profile_all(
    args: argparse.Namespace, model: torch.nn.Module, parts: Parts
) -> tuple[dict[str, float], Scoring, Timer]:
    """Every part in order but the C++ wrapper's (graphs are captured before the profiler
    first runs: a capture after a profiling session is where CUPTI and graph capture have
    clashed); the figures, and the scoring case and timer the C++ wrapper's part takes."""
    device, cases = torch.device(args.device), shapes(args.quick)
    timer = Timer(device, args.reps)
    figures: dict[str, float] = {}
    header(COPY)
    copy_gbs = parts.run("the copy ceiling", lambda: copy_ceiling_gbs(device, timer, args.quick))
    if copy_gbs:
        figures["copy_gbs"] = copy_gbs
        print(f"device-to-device copy: {copy_gbs:.0f} GB/s (bytes read + written)\n")
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the copy's buffers must not shrink the engine's KV budget
    header(DECODE, f"{cases.decode.name}, batch bucket, medians in ms")
    decode = parts.run("the decode warm-up", lambda: start_decode(model, cases.decode, device))
    if decode is not None:
        parts.run("the decode timings", lambda: decode_timings(model, decode, timer, figures))
        if decode.shared is not None:
            parts.run("the shared-prefix steps",
                      lambda: shared_step_timings(decode, timer, figures))  # fmt: skip
        parts.run("the decode attention variants",
                  lambda: attention_variants(decode, args.reps, figures))  # fmt: skip
    header(SAMPLER, "medians in ms")
    if decode is not None:
        parts.run("the sampler", lambda: sampler_timings(decode, timer, figures))
    header(DECODE_KERNELS, "torch.profiler")
    if decode is not None:
        parts.run("the decode profiles",
                  lambda: decode_profiles(decode, args.profile_steps, args.top))  # fmt: skip
    scoring = scoring_calls(model, cases.scoring)
    header(SCORING, f"{cases.scoring.rows} rows x ({cases.scoring.prompt_len} + "
                    f"{cases.scoring.new_tokens}), engine path, medians in ms")  # fmt: skip
    parts.run("the scoring", lambda: scoring_timings(scoring, timer, figures))
    header(SCORING_KERNELS, f"top {args.scoring_top} of one action_log_probs call")
    parts.run("the scoring kernels", lambda: scoring_kernels(scoring, device, args.scoring_top))
    header(NEW_SHAPES, f"{cases.scoring.prompt_len}-token prompts, engine forward, wall ms")
    parts.run("the new prefill shapes",
              lambda: new_shape_costs(model, cases.scoring, device, figures))  # fmt: skip
    return figures, scoring, timer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available: nothing to profile (try --device cpu --quick).")
        return 0
    # A part stuck past the budget leaves its stacks in the log before gpu_checks.sh's timeout.
    faulthandler.dump_traceback_later(args.budget_s + 8, exit=False)
    parts = Parts(Budget(args.budget_s))
    if args.quick and args.device == "cpu":
        # The tiny model gains nothing from threads, and on a busy host their OpenMP barriers
        # stall: one thread keeps the smoke run's time steady.
        torch.set_num_threads(1)
    size = "small" if args.quick else args.model
    model = build_model(size, 512, 64, 2, getattr(torch, args.dtype), args.device)
    model.requires_grad_(False)  # as a server loads it: F.linear picks other kernels otherwise
    case = shapes(args.quick).decode
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    header(SETUP)
    print(f"device {name}, torch {torch.__version__}, model {size} {args.dtype} "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, vocab "
          f"{model.config.vocab_size}); decode {case.rows} rows, prompt {case.prompt_len}, "
          f"{case.new_tokens} new tokens; medians of {args.reps}; budget {args.budget_s:.0f} s\n",
          flush=True)  # fmt: skip
    with torch.inference_mode():
        figures, scoring, timer = profile_all(args, model, parts)
        print_summary(figures, figures.get("copy_gbs"))
        header(CPP_WRAPPER, "the scoring case's decoder body, medians")
        parts.run("the C++ wrapper", lambda: cpp_wrapper_body(scoring, timer))
    failed = f"; FAILED: {', '.join(parts.failed)}" if parts.failed else ""
    print(f"\nrun took {parts.budget.spent():.0f} s{failed}", flush=True)
    faulthandler.cancel_dump_traceback_later()
    return 1 if parts.failed else 0


if __name__ == "__main__":
    sys.exit(main())
