"""The GPU figures of issue 19 in one run: the engine against Hugging Face `generate` on the
same rows, then MakeExperience end to end, in-process and over gRPC.

The model is a random Qwen2-0.5B-shaped model of bench_generation.py (no download; by default
the issue's: vocab 32,000, tied embeddings, 386M parameters; --model 0.5b for the 151,936
vocabulary of the figures before 2026-11-27), in bfloat16, with a word-level tokenizer of its
vocabulary. Rows are GRPO-shaped (distinct prompts x samples per prompt) and every row makes
exactly new_tokens tokens (no EOS), so tokens/s are comparable across lanes. A failing lane
prints its error and the run goes on; a watchdog ends the run (and its server process) when
--budget-s is spent.

1. Generation: HF `generate` (dynamic cache, temperature 1, top-k and top-p off) against the
   engine (CUDA graphs and compiled layers: the CUDA default), after the engine's warm-up on
   dummy prompts of the same shape (what a server runs before SERVING); first call, steady
   median, the allocator's peak. --all-lanes adds batch 32, HF with its static cache, and the
   engine with graphs only and eager.
2. MakeExperience, the issue's case (64 prompts x 8, 128-token prompts, 256 new tokens,
   temperature 1, group_norm, an exact_match reward; generate, actor and reference scoring,
   rewards), on the model saved to a directory and loaded by the server code:
     in-process      NaiveExperienceMaker.make_experience on this thread (a RolloutServer in
                     this process, warmed up on one row: its first call captures graphs)
     engine thread   the same maker through the engine's job thread, no gRPC (diagnostic)
     grpc, same proc RolloutClient against that in-process server (diagnostic)
     in-process, again  the first lane once more (diagnostic: the thread or the time?)
                     The three diagnostics take turns, a call of each per round, two rounds.
     grpc            RolloutClient against `python -m rollserve.server serve --device cuda
                     --dtype bfloat16 --actor DIR` in its own process: seconds to SERVING,
                     the first request after SERVING, steady best of 3; its device memory from
                     /metrics (rollserve_device_memory_bytes) after start and after the requests
   Each lane prints its phases (info time/<phase>_s summed over the rows) and the seconds
   outside them (streaming, transfer, joining), which is where gRPC differs from in-process.
   Before it, scoring alone: actor log-probs of the same rows on the HF path and on the
   engine path (forward batch 64), and each path's decoder body alone (best of 3 after a warm
   call, the lanes taking turns: a drift across the section falls on every lane alike).
3. The ratios the issue sets targets for.
4. The small request of bench_make_experience.py (32 prompts x 4, 64 new tokens, a random
   Llama of hidden 256 x 4 layers, the server's default dtype): in-process against gRPC from a
   client process, rounds interleaved; the issue measured 1.29 there on an H100.

    python bench/bench_gpu.py                          # one H100/H200: under 5 minutes
    python bench/bench_gpu.py --device cpu --quick     # every lane's code on the CPU (< 1 min)
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generation import (  # noqa: E402
    GPU_BENCH_MODEL,
    QWEN2_05B_VOCAB,
    build_model,
    grouped_prompts,
)
from bench_make_experience import save_tokenizer  # noqa: E402
from rollserve.server.experience.generation import SamplingParams, generate, left_pad  # noqa: E402
from rollserve.server.experience.timing import PHASES, PhaseClock, phase_key  # noqa: E402
from rollserve.server.generation import Engine, engine_for, read_family  # noqa: E402

MEMORY_KINDS = ("allocated", "reserved", "peak_allocated", "peak_reserved")
GIB = float(1 << 30)


@dataclass(frozen=True)
class Case:
    """Rows of one measurement: prompts x samples, fixed prompt length, new tokens per row."""

    name: str
    prompts: int
    samples: int
    prompt_len: int
    new_tokens: int

    @property
    def rows(self) -> int:
        return self.prompts * self.samples

    @property
    def tokens(self) -> int:
        return self.rows * self.new_tokens


def generation_cases(quick: bool, all_lanes: bool = True) -> list[Case]:
    """The last case is the issue's (and the end-to-end one); batch 32 only with --all-lanes."""
    if quick:
        return [Case("quick 4x2", 4, 2, 16, 16), Case("quick 8x4", 8, 4, 24, 24)]
    small = [Case("batch 32", 4, 8, 128, 256)] if all_lanes else []
    return [*small, Case("64 prompts x 8", 64, 8, 128, 256)]


@dataclass(frozen=True)
class Batching:
    """Rows per generation call, per scoring forward and per streamed micro-batch."""

    generate: int
    forward: int
    micro: int


def end_to_end_case(quick: bool) -> tuple[Case, Batching]:
    """The issue's case (the last generation case, so its HF rate is the baseline)."""
    case = generation_cases(quick)[-1]
    return case, Batching(generate=case.rows, forward=4 if quick else 64, micro=4 if quick else 16)


# ---- timing helpers ---------------------------------------------------------------------------


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


@contextmanager
def environment(name: str, value: str | None) -> Iterator[None]:
    """os.environ[name] = value inside (None: as it is), as it was after."""
    before = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def memory(device: str) -> str:
    if not device.startswith("cuda"):
        return "-"
    allocated = torch.cuda.max_memory_allocated() / GIB
    return f"{allocated:.1f}/{torch.cuda.max_memory_reserved() / GIB:.1f} GiB"


def phases_peak(device: str, peaks: dict[str, PhaseMemory]) -> str:
    """The device memory a lane measured with phase_memory peaked at: its phases' largest peak
    (phase_memory resets the allocator's peak at each phase, so `memory` would read the last
    phase's alone), and what the allocator holds now."""
    if not device.startswith("cuda") or not peaks:
        return "peak alloc/reserved -"
    top, reserved = max(m.peak for m in peaks.values()), torch.cuda.memory_reserved()
    return f"peak alloc {top / GIB:.1f} GiB (its phases'), reserved now {reserved / GIB:.1f} GiB"


def reset_memory(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class Budget:
    """The run's wall-clock budget: lanes ask what is left; a watchdog ends the process (and
    the server it started) when it is spent, printing every thread's stack first."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.children: list[subprocess.Popen] = []
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return self.end - time.monotonic()

    def deadline_s(self, reserve_s: float) -> float:
        """A wait bound that leaves `reserve_s` of the run for printing what was measured."""
        return max(self.left() - reserve_s, 1.0)

    def _expire(self) -> None:
        print("\nBUDGET SPENT: stopping the run (stacks follow)", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        for child in self.children:
            child.kill()
        os._exit(124)

    def cancel(self) -> None:
        self._timer.cancel()


def failure(error: BaseException) -> str:
    traceback.print_exc()
    return f"FAILED {type(error).__name__}: {error}"[:200]


# ---- 1. generation ----------------------------------------------------------------------------


def generation_lanes(model, case: Case, device: str, all_lanes: bool) -> dict[str, Callable]:
    vocab = model.config.vocab_size
    prompts = grouped_prompts(case.rows, case.samples, case.prompt_len, case.prompt_len, vocab, 1)
    ids, mask = left_pad(prompts, 0, torch.device(device))
    params = SamplingParams(max_new_tokens=case.new_tokens, temperature=1.0)

    def hf() -> None:
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=mask.long(), max_new_tokens=case.new_tokens,
                do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0,
            )  # fmt: skip

    def engine_warm_up() -> None:  # what a server runs before reporting SERVING
        engine_for(model, "rollserve").warm_up(params, len(prompts), ids.shape[1], pad_token_id=0)

    def engine() -> None:
        g = torch.Generator(device=device).manual_seed(0)
        generate(model, prompts, params, pad_token_id=0, generator=g, path="rollserve")

    lanes = {"hf": hf, "engine_warm_up": engine_warm_up, "engine": engine}
    if all_lanes:  # they taught what they had to (RESULTS.md): graphs are the lever

        def hf_static() -> None:  # HF's static cache, which its generate compiles by itself
            with torch.inference_mode():
                model.generate(
                    input_ids=ids, attention_mask=mask.long(), max_new_tokens=case.new_tokens,
                    do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0,
                    cache_implementation="static",
                )  # fmt: skip

        family = read_family(model)
        plain = Engine(model, family, compiled=False)
        eager = Engine(model, family, cuda_graphs=False, compiled=False)

        def engine_uncompiled() -> None:
            g = torch.Generator(device=device).manual_seed(0)
            plain.generate(ids, mask, params, pad_token_id=0, generator=g)

        def engine_eager() -> None:
            g = torch.Generator(device=device).manual_seed(0)
            eager.generate(ids, mask, params, pad_token_id=0, generator=g)

        lanes.update(
            hf_static=hf_static, engine_uncompiled=engine_uncompiled, engine_eager=engine_eager
        )
    return lanes


def run_generation_case(
    model, case: Case, args: argparse.Namespace, budget: Budget, rates: dict[tuple[str, str], float]
) -> list[list[str]]:
    """One table row per lane: case, lane, tokens/s, first and steady seconds, peak memory,
    ratio to HF; a failing lane's row carries its error. Steady rates go into `rates`."""
    device = args.device
    rows: list[list[str]] = []
    for name, fn in generation_lanes(model, case, device, args.all_lanes).items():
        if budget.left() < args.lane_reserve_s:
            rows.append([case.name, name, "skipped: out of budget"])
            print("| " + " | ".join(rows[-1]) + " |", flush=True)
            continue
        try:
            reset_memory(device)
            started = time.monotonic()
            first = timed(fn, device)
            if name == "engine_warm_up":  # once: its cost is the first call's
                rows.append([case.name, name, "-", f"{first:.2f}", "-", memory(device), "-"])
                print("| " + " | ".join(rows[-1]) + " |", flush=True)
                continue
            reps = 1 if name == "engine_eager" else (args.hf_reps if name == "hf" else args.reps)
            steady = []
            for _ in range(reps):
                if steady and time.monotonic() - started > args.lane_budget_s:
                    break  # enough: this lane has had its share of the run
                steady.append(timed(fn, device))
            seconds = statistics.median(steady)
        except Exception as error:  # noqa: BLE001 - one failing lane must not end the run
            rows.append([case.name, name, failure(error)])
            print("| " + " | ".join(rows[-1]) + " |", flush=True)
            continue
        rate = case.tokens / seconds
        rates[(case.name, name)] = rate
        hf_rate = rates.get((case.name, "hf"))
        ratio = f"{rate / hf_rate:.2f}x" if hf_rate else "-"
        rows.append([case.name, name, f"{rate:,.0f}", f"{first:.2f}",
                     f"{seconds:.2f} ({len(steady)})", memory(device), ratio])  # fmt: skip
        print("| " + " | ".join(rows[-1]) + " |", flush=True)
    return rows


# ---- 1b. scoring -------------------------------------------------------------------------------

SCORING_REPS = 3  # best of, after one warm call


@dataclass
class ScoringLane:
    """One scoring lane's calls: the warm one, the steady ones, the allocator's peak above
    what was allocated before a call (GiB, the largest of its calls), or its failure."""

    first: float | None = None
    steady: list[float] = field(default_factory=list)
    peak: float = 0.0
    error: str = ""


def scoring_rows(case: Case, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The end-to-end case's rows as scoring sees them: distinct prompts x samples (a group's
    rows share their prompt columns), then new_tokens response tokens; no padding."""
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(1, vocab, (case.prompts, case.prompt_len), generator=g)
    responses = torch.randint(1, vocab, (case.rows, case.new_tokens), generator=g)
    sequences = torch.cat([prompts.repeat_interleave(case.samples, 0), responses], 1)
    return sequences.to(device), torch.ones_like(sequences, device=device)


def scoring_section(model, args: argparse.Namespace, budget: Budget) -> None:
    """Actor log-probs of the end-to-end case's rows (one forward batch at a time), on the HF
    path and on the engine path, and each path's decoder body alone (the rest is the chunked
    lm_head): best of SCORING_REPS after a warm call, with the allocator's peak above what
    was allocated before. Tells the lm_head loop from the forward when scoring is slow."""
    from rollserve.server.experience.scoring import (
        action_log_probs,
        default_positions_per_chunk,
        lm_head_plan,
        position_ids_from_mask,
    )
    from rollserve.server.experience.vocab_chunks import (
        VOCAB_CHUNKS_ENV,
        vocab_chunks_enabled,
        vocab_plan,
    )
    from rollserve.server.generation import scoring_forward

    case, batching = end_to_end_case(args.quick)
    device, rows = args.device, batching.forward
    # As a server loads its models (models/loading.py); F.linear takes other kernels for a
    # weight that requires grad, so the lanes would not measure what a server runs.
    model.requires_grad_(False)
    sequences, mask = scoring_rows(case, model.config.vocab_size, device)
    actions = case.new_tokens
    chunk = default_positions_per_chunk(model)
    plan = lm_head_plan(rows, actions, chunk)
    vocab = model.get_output_embeddings().weight.shape[0]
    chunks = vocab_plan(rows * actions, vocab, model.get_output_embeddings().weight.element_size())
    default = (
        "vocabulary chunks" if vocab_chunks_enabled(torch.device(device)) else "position blocks"
    )
    print(
        f"\n## Scoring ({case.rows} rows x ({case.prompt_len} prompt + {actions} actions), "
        f"forward batch {rows}; lm_head in position blocks: {plan.rows} rows x {plan.columns} "
        f"columns, {plan.blocks} per forward batch; in vocabulary chunks (vocab_chunks.py, "
        f"compiled): passes of {chunks.positions} positions x chunks of {chunks.columns} ids; this "
        f"device's default: {default}; best of {SCORING_REPS} after one warm call, the lanes "
        "taking turns)\n"
    )
    print("| lane | seconds | peak above start GiB |\n| --- | --- | --- |", flush=True)

    def log_probs(path: str, vocab_chunks: str | None = None) -> Callable[[], object]:
        def run() -> object:
            with environment(VOCAB_CHUNKS_ENV, vocab_chunks):
                return action_log_probs(
                    model, sequences, mask, actions, forward_batch_size=rows, temperature=1.0,
                    path=path,
                )  # fmt: skip

        return run

    def body(path: str) -> Callable[[], object]:
        forward = scoring_forward(model, path)

        def run() -> None:
            with torch.inference_mode():
                for start in range(0, case.rows, rows):
                    ids, m = sequences[start : start + rows], mask[start : start + rows]
                    positions = position_ids_from_mask(m)
                    if forward is None:
                        model.model(input_ids=ids, attention_mask=m, position_ids=positions,
                                    use_cache=False)  # fmt: skip
                    else:
                        forward.hidden_states(ids, m, positions, case.prompt_len)

        return run

    lanes = {
        "actor log-probs, hf path": log_probs("hf"),
        "actor log-probs, engine path": log_probs("rollserve"),
        "actor log-probs, engine path, position blocks": log_probs("rollserve", "0"),
        "actor log-probs, engine path, vocabulary chunks": log_probs("rollserve", "1"),
        "decoder body only, hf path": body("hf"),
        "decoder body only, engine path": body("rollserve"),
    }
    # A warm call of each, then the lanes in turns (a call of each per round): on an H200 the
    # engine lanes here took 1.65x HF's, run one after another, while the profile's scoring
    # batch and the maker's actor phase said ~1x; a drift across the section (compile workers
    # of the engine's warm-up, the clocks) now falls on every lane alike.
    on_cuda = device.startswith("cuda")
    measured = {name: ScoringLane() for name in lanes}

    def call(lane: ScoringLane, fn: Callable[[], object]) -> None:
        try:
            gc.collect()
            reset_memory(device)
            before = torch.cuda.memory_allocated() if on_cuda else 0
            seconds = timed(fn, device)
            if on_cuda:
                lane.peak = max(lane.peak, (torch.cuda.max_memory_allocated() - before) / GIB)
        except Exception as error:  # noqa: BLE001 - one failing lane must not end the run
            lane.error = failure(error)
            return
        if lane.first is None:
            lane.first = seconds
        else:
            lane.steady.append(seconds)

    for rep in range(SCORING_REPS + 1):
        for name, fn in lanes.items():
            lane = measured[name]
            if budget.left() < args.lane_reserve_s + diagnostic_reserve_s(args) or lane.error:
                continue
            if rep > 1 and lane.first is not None and lane.first >= 4.0:
                continue  # a slow lane gets one steady call: it must not eat the run
            call(lane, fn)
    for name, lane in measured.items():
        peak = f"{lane.peak:.2f}" if on_cuda else "nan"
        if lane.error:
            print(f"| {name} | {lane.error} | - |")
        elif lane.first is None:
            print(f"| {name} | skipped: out of budget (the gRPC lane's reserve) | - |")
        elif not lane.steady:
            print(f"| {name} | no steady call (first {lane.first:.2f}) | {peak} |")
        else:
            print(f"| {name} | {min(lane.steady):.3f} (first {lane.first:.2f}) | {peak} |")
    sys.stdout.flush()


# ---- 2. MakeExperience end to end -------------------------------------------------------------


def save_checkpoint(model, directory: Path) -> Path:
    """`model` and a word-level tokenizer of its vocabulary, as a server loads them."""
    model.save_pretrained(directory)
    save_tokenizer(directory, model.config.vocab_size)
    return directory


def experience_request(case: Case, batching: Batching, vocab: int) -> tuple[list, dict]:
    """The prompts (ids >= 3: no special tokens) and the options of the issue's request."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (case.prompt_len,), generator=g).tolist()
               for _ in range(case.prompts)]  # fmt: skip
    options = dict(
        samples_per_prompt=case.samples, max_new_tokens=case.new_tokens, temperature=1.0,
        seed=1234, ignore_eos=True, algorithm={"advantage_estimator": "group_norm"},
        rewards=["exact_match"], gt_answers=[f"w{i + 3}" for i in range(case.prompts)],
        generate_batch_size=batching.generate, forward_batch_size=batching.forward,
        micro_batch_size=batching.micro,
    )  # fmt: skip
    return prompts, options


def server_flags(args: argparse.Namespace, case: Case, batching: Batching) -> dict[str, object]:
    """ServerConfig fields, and the command line's flags, shared by both servers: defaults
    equal to the request, so the start-up warm-up builds what the request uses."""
    flags: dict[str, object] = dict(
        device=args.device, dtype=args.dtype, max_new_tokens=case.new_tokens,
        generate_batch_size=batching.generate, forward_batch_size=batching.forward,
        micro_batch_size=batching.micro,
    )  # fmt: skip
    if args.quick:  # the CUDA default is the engine already; on the CPU it must be asked for
        flags["generation_path"] = "rollserve"
    if args.kv_cache_tokens:
        flags["kv_cache_tokens"] = args.kv_cache_tokens
    return flags


def phase_seconds(experience) -> dict[str, float]:
    """Seconds of one request in each phase that ran: info time/<phase>_s summed over rows."""
    out = {}
    for phase in PHASES:
        tensor = experience.info.get(phase_key(phase))
        if tensor is not None and float(tensor.double().sum()) > 0:
            out[phase] = float(tensor.double().sum())
    return out


@dataclass(frozen=True)
class PhaseMemory:
    """Device bytes of one maker phase: allocated when it began, the allocator's peak during it."""

    start: int
    peak: int


@dataclass(frozen=True)
class MemoryCounters:
    """The allocator's figures phase_memory reads: bytes allocated now, reset the peak, the peak."""

    allocated: Callable[[], int]
    reset_peak: Callable[[], None]
    peak: Callable[[], int]


def cuda_counters(device: str) -> MemoryCounters | None:
    """The CUDA caching allocator's counters of the current device; None off CUDA."""
    if not device.startswith("cuda"):
        return None
    cuda = torch.cuda
    return MemoryCounters(cuda.memory_allocated, cuda.reset_peak_memory_stats,
                          cuda.max_memory_allocated)  # fmt: skip


@contextmanager
def phase_memory(counters: MemoryCounters | None) -> Iterator[dict[str, PhaseMemory]]:
    """While inside, every maker phase run in this process (timing.PhaseClock.phase, on any
    thread) records the device memory allocated at its start and the allocator's peak during
    it, keeping each phase's call with the largest peak: which phase sets a request's peak,
    and how far above what it started from (the server's memory target: peak <= 1.25 x
    weights + KV of the batch). Nothing is recorded without counters (off CUDA).

    A phase boundary synchronises the device (PhaseClock), and the allocator counts at
    allocation time, on the host: the peak is the phase's own, not its neighbours'."""
    peaks: dict[str, PhaseMemory] = {}
    if counters is None:
        yield peaks
        return
    original = PhaseClock.phase

    @contextmanager
    def measured(clock: PhaseClock, name: str) -> Iterator[None]:
        with original(clock, name):
            start = counters.allocated()
            counters.reset_peak()
            try:
                yield
            finally:
                peak = counters.peak()
                if name not in peaks or peak > peaks[name].peak:
                    peaks[name] = PhaseMemory(start, peak)

    PhaseClock.phase = measured
    try:
        yield peaks
    finally:
        PhaseClock.phase = original


@dataclass
class Lane:
    """A measured end-to-end lane: first call, steady calls, the steady best's phases."""

    name: str
    first_s: float | None = None
    steady_s: list[float] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    first_phases: dict[str, float] = field(default_factory=dict)
    error: str = ""
    note: str = ""
    memory: dict[str, PhaseMemory] = field(default_factory=dict)  # by phase (phase_memory)
    # This process's CPU seconds (every thread's) in the steady best: beside its wall time,
    # work added (compiles, collections, another busy thread) from time spent waiting.
    best_cpu_s: float | None = None

    @property
    def best_s(self) -> float | None:
        return min(self.steady_s) if self.steady_s else None


def diagnostic_reserve_s(args: argparse.Namespace) -> float:
    """What a diagnostic lane leaves unspent: the gRPC lane's reserve (unless it is skipped).
    On an H200 (2026-11-27) the diagnostics ran first and the gRPC lane's server got too little
    of a 175 s budget to bind: the run printed none of the issue's gRPC figures."""
    return 0.0 if "grpc" in args.skip else args.grpc_reserve_s


def measure(
    name: str,
    call: Callable[[], object],
    *,
    reps: int,
    args: argparse.Namespace,
    budget: Budget,
    device: str,
    first: bool = True,
    reserve_s: float = 0.0,
) -> Lane:
    """Time `call` (a first call when `first`, then up to `reps` steady ones within the lane's
    budget); a failure ends the lane with its error. reserve_s: seconds to leave to later
    lanes (the lane is skipped with less than that left beyond its own reserve)."""
    lane = Lane(name)
    if budget.left() < args.lane_reserve_s + reserve_s:
        lane.error = "skipped: out of budget"
        return lane
    started = time.monotonic()

    def one_call() -> tuple[float, dict[str, float], float]:
        sync(device)
        begin, cpu_begin = time.perf_counter(), time.process_time()
        experience = call()
        sync(device)
        seconds, cpu_s = time.perf_counter() - begin, time.process_time() - cpu_begin
        return seconds, phase_seconds(experience), cpu_s

    try:
        if first:
            lane.first_s, lane.first_phases, _ = one_call()
        graphs_before = compiled_graphs()
        for _ in range(reps):
            if lane.steady_s and time.monotonic() - started > args.lane_budget_s:
                break
            seconds, phases, cpu_s = one_call()
            if not lane.steady_s or seconds < min(lane.steady_s):
                lane.phases, lane.best_cpu_s = phases, cpu_s
            lane.steady_s.append(seconds)
        # Steady calls that still compile are not steady (in this process only: a server
        # process's own compiles show in its log).
        compiled = compiled_graphs() - graphs_before
        if compiled:
            lane.note = f"{lane.note}; " if lane.note else ""
            lane.note += f"dynamo compiled {compiled} graph(s) during the steady calls"
    except Exception as error:  # noqa: BLE001 - one failing lane must not end the run
        lane.error = failure(error)
    return lane


def in_turns(calls: dict[str, Callable[[], object]], rounds: int, **measured: Any) -> list[Lane]:
    """`measure` of each call (its keywords in `measured`), one steady call of each lane per
    round, `rounds` rounds: the lanes, each with its calls merged. A lane that failed or ran
    out of budget is not called again."""
    lanes = {name: Lane(name) for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            lane = lanes[name]
            if lane.error:
                continue
            one = measure(name, call, reps=1, **measured)
            lane.error, lane.note = one.error, "; ".join(filter(None, (lane.note, one.note)))
            if one.best_s is not None and (lane.best_s is None or one.best_s < lane.best_s):
                lane.phases, lane.best_cpu_s = one.phases, one.best_cpu_s
            lane.steady_s += one.steady_s
    return list(lanes.values())


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _phases_cell(phases: dict[str, float]) -> str:
    return " ".join(f"{k.removeprefix('score_')} {v:.2f}" for k, v in phases.items()) or "-"


def lane_row(lane: Lane, case: Case) -> list[str]:
    if lane.best_s is None:
        return [lane.name, lane.error or "no steady call", "", "", "", "", "", lane.note]
    inside = sum(lane.phases.values())
    phases = _phases_cell(lane.phases)
    first = "-"
    if lane.first_s is not None:  # and how much of it was outside the phases
        first = f"{lane.first_s:.2f} ({lane.first_s - sum(lane.first_phases.values()):.2f} out)"
    steady = f"{lane.best_s:.2f} (best of {len(lane.steady_s)})"
    if lane.best_cpu_s is not None:  # every thread of this process, not a server process's
        steady += f", CPU {lane.best_cpu_s:.2f} s"
    # The first call's phases: where a first request's extra seconds go (compiles, plans).
    first_phases = _phases_cell(lane.first_phases) if lane.first_s is not None else "-"
    return [lane.name, f"{case.tokens / lane.best_s:,.0f}", first, first_phases, steady, phases,
            f"{lane.best_s - inside:.3f}", lane.note or lane.error]  # fmt: skip


def print_lane(lane: Lane, case: Case) -> Lane:
    print("| " + " | ".join(lane_row(lane, case)) + " |", flush=True)
    return lane


def in_process_lanes(
    directory: Path, case: Case, batching: Batching, args: argparse.Namespace, budget: Budget
) -> list[Lane]:
    """The maker in this process: on this thread, on the engine's thread, and over gRPC to
    the in-process server (a client in this process)."""
    from rollserve.client import RolloutClient
    from rollserve.client.protocol.experience import concat_experiences
    from rollserve.client.protocol.requests import build_make_experience_request
    from rollserve.server.config import ServerConfig
    from rollserve.server.models import load_models
    from rollserve.server.serving.app import RolloutServer

    device = args.device
    # Its start-up warm-up on one row compiles the step; the first call captures the request's
    # graphs (the server process's warm-up covers the request: that first call is measured).
    flags = {**server_flags(args, case, batching), "generate_batch_size": 1}
    config = ServerConfig(
        host="127.0.0.1", port=0, actor=str(directory), log_level="WARNING", metrics_port=0,
        **flags,
    )  # fmt: skip
    reset_memory(device)
    started = time.perf_counter()
    server = RolloutServer(config, models=load_models(config))
    server.start()  # loads, warms the engine up, reports SERVING
    start_s = time.perf_counter() - started
    lanes: list[Lane] = []
    try:
        maker, runtime = server.runtime.maker, server.runtime
        prompts, options = experience_request(case, batching, maker.models.vocab_size)

        def on_this_thread():
            return maker.make_experience(prompts, **options)

        def on_engine_thread():
            spec = maker.decode(build_make_experience_request(prompts, **options))
            parts = runtime.engine.stream(lambda: maker.iter_experience(spec, policy_version=0))
            return concat_experiences(list(parts), pad_token_id=maker.pad_token_id)

        common = dict(args=args, budget=budget, device=device)
        with phase_memory(cuda_counters(device)) as peaks:
            lane = measure("in-process", on_this_thread, reps=args.reps, **common)
        lane.memory = peaks
        lane.note = "; ".join(filter(None, (
            f"server start to SERVING {start_s:.1f} s; {phases_peak(device, peaks)} "
            "(this process: the generation lanes' model and engine included)", lane.note,
        )))  # fmt: skip
        lanes.append(print_lane(lane, case))
        # The diagnostics, two calls each, taken in turns (a call of each, then again): the
        # H200's best-of-1 lanes (2026-11-27: 2.72 s on the engine thread, 2.69 over gRPC,
        # against 1.98 on this thread) could not tell a first call on another thread, or a
        # slower stretch of the process's life, from a steady cost of the thread. In turns,
        # a stretch falls on every lane; "in-process, again" (this thread, as the first lane)
        # then tells the thread from the time since start-up.
        timeout_s = budget.deadline_s(args.lane_reserve_s)
        with RolloutClient(server.address, timeout_s=timeout_s) as client:
            calls = {
                "engine thread": on_engine_thread,
                "grpc, same process": lambda: client.make_experience(prompts, **options),
                "in-process, again": on_this_thread,
            }
            diagnostic = dict(first=False, reserve_s=diagnostic_reserve_s(args), **common)
            lanes += [print_lane(lane, case) for lane in in_turns(calls, 2, **diagnostic)]
    finally:
        server.stop(0)
    return lanes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def scrape_memory(metrics_port: int) -> dict[str, float]:
    """rollserve_device_memory_bytes by kind from a server's /metrics ({} off CUDA)."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    return {
        sample.labels["kind"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "rollserve_device_memory_bytes"
    }


@contextmanager
def server_process(
    directory: Path, flags: dict[str, object], budget: Budget, timeout_s: float
) -> Iterator[tuple[str, int, float, Path]]:
    """`python -m rollserve.server serve` on 127.0.0.1 with `flags`; yields its address, its
    metrics port, the seconds from launch to SERVING and its log file; stops it after."""
    from rollserve.client import RolloutClient

    workdir = Path(tempfile.mkdtemp(prefix="bench-gpu-server-"))
    port_file, log_path, metrics_port = workdir / "port", workdir / "server.log", free_port()
    command = [
        sys.executable, "-m", "rollserve.server", "serve", "--host", "127.0.0.1", "--port", "0",
        "--port-file", str(port_file), "--metrics-port", str(metrics_port), "--actor",
        str(directory), "--log-level", "INFO",
    ]  # fmt: skip
    for key, value in flags.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    print("server: " + " ".join(command[1:]), flush=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSERVE_")}
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    budget.children.append(proc)
    try:
        deadline = time.monotonic() + timeout_s
        while not port_file.exists() or not port_file.read_text().strip():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the server did not bind in {timeout_s:.0f} s, the lane's share of the "
                    f"budget (exit {proc.poll()})"
                )
            time.sleep(0.05)
        address = f"127.0.0.1:{int(port_file.read_text())}"
        with RolloutClient(address) as client:
            client.wait_until_ready(timeout_s=max(deadline - time.monotonic(), 1.0), poll_s=0.05)
        yield address, metrics_port, time.perf_counter() - started, log_path
    except BaseException:
        tail = log_path.read_text(errors="replace")[-4000:] if log_path.exists() else ""
        print(f"--- server log (tail) ---\n{tail}\n---", flush=True)
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        budget.children.remove(proc)


@dataclass
class ServerFigures:
    """What the gRPC lane learned about its server process."""

    lane: Lane
    start_s: float | None = None
    memory_start: dict[str, float] = field(default_factory=dict)
    memory_after: dict[str, float] = field(default_factory=dict)
    weights_bytes: int = 0
    generation_path: str = ""
    kv_cache_tokens: int = 0
    log_lines: list[str] = field(default_factory=list)  # SERVER_LOG_MARKS lines of its log


def grpc_lane(
    directory: Path, case: Case, batching: Batching, args: argparse.Namespace, budget: Budget
) -> ServerFigures:
    from rollserve.client import RolloutClient

    figures = ServerFigures(Lane("grpc"))
    if budget.left() < args.lane_reserve_s:
        figures.lane.error = "skipped: out of budget"
        return figures
    flags = server_flags(args, case, batching)
    try:
        start_s = min(args.server_start_s, budget.deadline_s(args.lane_reserve_s))
        with server_process(directory, flags, budget, start_s) as started:
            address, metrics_port, figures.start_s, log_path = started
            figures.memory_start = scrape_memory(metrics_port)
            timeout_s = budget.deadline_s(args.lane_reserve_s)
            with RolloutClient(address, timeout_s=timeout_s) as client:
                health = client.health()
                figures.generation_path = health.generation_path
                figures.kv_cache_tokens = health.kv_cache_tokens
                figures.weights_bytes = sum(
                    m.num_parameters * torch.empty((), dtype=getattr(torch, m.dtype)).itemsize
                    for m in health.models
                )
                prompts, options = experience_request(case, batching, health.vocab_size)
                figures.lane = measure(
                    "grpc",
                    lambda: client.make_experience(prompts, **options),
                    reps=args.reps,
                    args=args,
                    budget=budget,
                    device=args.device,
                )
            figures.memory_after = scrape_memory(metrics_port)
            figures.log_lines = server_log_lines(log_path.read_text(errors="replace"))
            figures.lane.note = "; ".join(filter(None, (
                f"server process: launch to SERVING {figures.start_s:.1f} s, path "
                f"{figures.generation_path}, KV {figures.kv_cache_tokens:,} tokens",
                figures.lane.note,
            )))  # fmt: skip
    except Exception as error:  # noqa: BLE001 - the run goes on to print what it has
        figures.lane.error = failure(error)
    print_lane(figures.lane, case)
    return figures


# The server's own account of its warm-up, read from its log: the engine's memory after it
# (weights, KV, graph pool, allocated/reserved and their peaks: where the memory target's peak
# sits), what the warm-up built and in how long, the decode attention it picked, and any
# compiler fallback to eager.
SERVER_LOG_MARKS = (
    "engine memory after the warm-up",
    "engine warm-up in",
    "decode attention (",
    "failed (",
)


def server_log_lines(log: str) -> list[str]:
    """The lines of a server's log that carry one of SERVER_LOG_MARKS, without the logger's
    prefix up to the message."""
    lines = []
    for line in log.splitlines():
        mark = next((m for m in SERVER_LOG_MARKS if m in line), None)
        if mark is not None:
            lines.append(line[line.index(mark) if mark != "failed (" else 0 :].strip())
    return lines


def kv_bytes_of_batch(config, case: Case, bytes_per_value: int) -> int:
    """K and V of every layer for rows x (prompt + new tokens) tokens."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * bytes_per_value
    return case.rows * (case.prompt_len + case.new_tokens) * per_token


@dataclass(frozen=True)
class ScoringWork:
    """The matmul work of scoring one model over the end-to-end case's rows, and this device's
    rate for it: what any scoring path must at least spend."""

    body_tflop: float  # the decoder body's matmuls over every token (a group's prompt once)
    head_tflop: float  # lm_head over every action position
    gemm_tflops: float  # bf16 (the run's dtype) rate of the model's MLP GEMM, measured here
    gemm_shape: tuple[int, int, int]  # (tokens, in, out) of that GEMM

    @property
    def floor_s(self) -> float:
        return (self.body_tflop + self.head_tflop) / self.gemm_tflops


def scoring_tflop(model: torch.nn.Module, case: Case) -> tuple[float, float]:
    """TFLOP of the matmuls of scoring the case's rows with `model` (2 x weights x tokens): its
    decoder body's weight matrices over every token (a GRPO group's prompt once, as the engine
    runs it), its lm_head over every action position. Attention's own matmuls (~1 % here)
    and the element-wise work are left out."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    body_params = matrices - embed.numel() - (0 if head is embed else head.numel())
    tokens = case.prompts * case.prompt_len + case.rows * case.new_tokens
    actions = case.rows * case.new_tokens
    return 2 * body_params * tokens / 1e12, 2 * head.numel() * actions / 1e12


def scoring_work(model: torch.nn.Module, case: Case, device: str, reps: int = 20) -> ScoringWork:
    """The case's scoring_tflop and the device's rate on one chunk of the model's gate/up GEMM
    (MLP_CHUNK_TOKENS tokens: the scoring forward's largest matmul), timed over `reps`
    back-to-back calls."""
    from rollserve.server.generation.model import MLP_CHUNK_TOKENS

    config = model.config
    dtype = model.get_input_embeddings().weight.dtype
    shape = (MLP_CHUNK_TOKENS, config.hidden_size, 2 * config.intermediate_size)
    x = torch.randn(shape[0], shape[1], dtype=dtype, device=device)
    w = torch.randn(shape[2], shape[1], dtype=dtype, device=device)
    out = torch.empty(shape[0], shape[2], dtype=dtype, device=device)

    def gemms() -> None:  # into one output: no allocation inside the timed calls
        for _ in range(reps):
            torch.matmul(x, w.t(), out=out)

    gemms()  # warm: the library picks its kernel
    seconds = timed(gemms, device)
    rate = 2 * shape[0] * shape[1] * shape[2] * reps / seconds / 1e12
    return ScoringWork(*scoring_tflop(model, case), rate, shape)


def print_scoring_room(
    case: Case, rates: dict[tuple[str, str], float], remote: Lane, work: ScoringWork | None
) -> None:
    """What the end-to-end target (3x HF generate alone) leaves for scoring, given the best
    gRPC request's other phases, against the floor of scoring's matmuls on this device."""
    print("\n## Room for scoring under the end-to-end target\n")
    hf = rates.get((case.name, "hf"))
    scored = [name for name in remote.phases if name.startswith("score_")]
    if hf is None or remote.best_s is None or work is None or not scored:
        print("n/a: needs the HF generate lane, the gRPC lane and the scoring work", flush=True)
        return
    target_s = case.tokens / hf / 3
    scoring_s = sum(remote.phases[name] for name in scored)
    others_s = remote.best_s - scoring_s
    room_s = (target_s - others_s) / len(scored)
    tokens, inner, outer = work.gemm_shape
    print(
        f"HF generate alone takes {case.tokens / hf:.2f} s, so the target (>= 3x) is a request "
        f"of {target_s:.2f} s. The best gRPC request spent {others_s:.2f} s outside scoring "
        f"(its other phases and the transfer), which leaves {room_s:.3f} s for each of its "
        f"{len(scored)} scored models ({', '.join(n.removeprefix('score_') for n in scored)}; "
        f"measured: {scoring_s / len(scored):.3f} s each). Scoring one model is "
        f"{work.body_tflop + work.head_tflop:.3g} TFLOP of matmuls ({work.body_tflop:.3g} "
        f"body, {work.head_tflop:.3g} lm_head); at this device's rate on the model's MLP GEMM "
        f"({tokens} x {inner} x {outer}: {work.gemm_tflops:.3g} TFLOP/s, measured here) the "
        f"matmuls alone take {work.floor_s:.3f} s per model: the target is "
        f"{'within reach of' if work.floor_s <= room_s else 'out of reach for'} scoring at "
        "that rate.",
        flush=True,
    )


# ---- 3. ratios --------------------------------------------------------------------------------


def ratio(numerator: float | None, denominator: float | None) -> str:
    if not numerator or not denominator:
        return "n/a"
    return f"{numerator / denominator:.2f}"


def print_summary(
    case: Case,
    rates: dict[tuple[str, str], float],
    lanes: dict[str, Lane],
    server: ServerFigures,
    kv_bytes: int,
) -> None:
    hf = rates.get((case.name, "hf"))
    engine = rates.get((case.name, "engine"))
    local, remote = lanes.get("in-process"), server.lane
    local_rate = case.tokens / local.best_s if local and local.best_s else None
    remote_rate = case.tokens / remote.best_s if remote.best_s else None
    peak = server.memory_after.get("peak_allocated")
    peak_reserved = server.memory_after.get("peak_reserved")
    need = server.weights_bytes + kv_bytes

    def gib(d: dict[str, float], kind: str) -> str:
        return f"{d[kind] / GIB:.2f}" if kind in d else "-"

    print(f"\n## Ratios ({case.name}: {case.rows} rows x {case.new_tokens} new tokens)\n")
    print("| ratio | value | target |")
    print("| --- | --- | --- |")
    print(f"| generation alone: engine / HF generate | {ratio(engine, hf)} | >= 5 |")
    print(f"| MakeExperience in-process / HF generate alone | {ratio(local_rate, hf)} | >= 3 |")
    print(f"| MakeExperience over gRPC / HF generate alone | {ratio(remote_rate, hf)} | >= 3 |")
    local_s = local.best_s if local else None
    print(f"| gRPC / in-process (steady best) | {ratio(remote.best_s, local_s)} | <= 1.05 |")
    for name in ("engine thread", "grpc, same process", "in-process, again"):
        other = lanes.get(name)
        print(f"| {name} / in-process (diagnostic) "
              f"| {ratio(other.best_s if other else None, local_s)} | - |")  # fmt: skip
    print(f"| gRPC first request after SERVING / steady | {ratio(remote.first_s, remote.best_s)} "
          "| <= 1.5 |")  # fmt: skip
    print(f"| server peak allocated / (weights + KV of the batch) | {ratio(peak, need)} "
          "| <= 1.25 |")  # fmt: skip
    print(f"| server peak reserved / (weights + KV of the batch) | {ratio(peak_reserved, need)} "
          "| - |")  # fmt: skip
    print(
        f"\nserver memory GiB (allocated/reserved/peak allocated/peak reserved): after start "
        f"{'/'.join(gib(server.memory_start, k) for k in MEMORY_KINDS)}, after the requests "
        f"{'/'.join(gib(server.memory_after, k) for k in MEMORY_KINDS)}; weights "
        f"{server.weights_bytes / GIB:.2f} GiB (every loaded model), KV of the batch "
        f"{kv_bytes / GIB:.2f} GiB"
    )
    print(phase_memory_line(local.memory if local else {}, server.weights_bytes + kv_bytes))
    for line in server.log_lines:
        print(f"server log: {line}")


def phase_memory_line(memory: dict[str, PhaseMemory], need: int) -> str:
    """Where the in-process lane's device memory peaked, phase by phase (phase_memory)."""
    if not memory:
        return "in-process phases' device memory: n/a (CUDA only)"
    cells = [
        f"{name.removeprefix('score_')} {m.start / GIB:.2f} -> {m.peak / GIB:.2f} "
        f"(+{(m.peak - m.start) / GIB:.2f})"
        for name, m in memory.items()
    ]
    top_name, top = max(memory.items(), key=lambda item: item[1].peak)
    share = f", {top.peak / need:.2f} x weights + KV of the batch" if need else ""
    return (
        "in-process phases' device memory GiB (allocated at the phase's start -> the "
        f"allocator's peak during it, its call with the largest peak): {', '.join(cells)}; "
        f"the peak is {top_name}'s{share} (this process: what the generation lanes left "
        "included, so read the + figures)"
    )


# ---- 4. the small request of bench_make_experience.py ------------------------------------------


def small_request(args: argparse.Namespace, budget: Budget) -> None:
    """bench_make_experience.py's case: in-process maker vs gRPC from a client process."""
    from bench_make_experience import GrpcRunner, save_model, workload
    from rollserve.server.config import ServerConfig
    from rollserve.server.models import load_models
    from rollserve.server.serving.app import RolloutServer

    sizes = dict(prompts=8, samples=2, new_tokens=8, vocab=512, hidden=64, layers=2)
    if not args.quick:
        sizes = dict(prompts=32, samples=4, new_tokens=64, vocab=16384, hidden=256, layers=4)
    shape = argparse.Namespace(**sizes)
    print(
        f"\n## Small request (bench_make_experience.py: {shape.prompts} prompts x "
        f"{shape.samples}, {shape.new_tokens} new tokens, Llama hidden {shape.hidden} x "
        f"{shape.layers}, vocab {shape.vocab}; gRPC from a client process)\n",
        flush=True,
    )
    if budget.left() < args.lane_reserve_s:
        print("skipped: out of budget")
        return
    with tempfile.TemporaryDirectory(prefix="bench-gpu-small-") as tmp:
        directory = save_model(Path(tmp), shape.vocab, shape.hidden, shape.layers)
        config = ServerConfig(
            host="127.0.0.1", port=0, actor=str(directory), device=args.device,
            log_level="WARNING", metrics_port=0,
        )  # fmt: skip
        server = RolloutServer(config, models=load_models(config))
        server.start()
    maker = server.runtime.maker
    prompts, options = workload(shape)
    runner = GrpcRunner("process", server.address, prompts, options)
    in_thread = GrpcRunner("thread", server.address, prompts, options)  # diagnostic
    try:

        def in_process() -> float:
            return timed(lambda: maker.make_experience(prompts, **options), args.device)

        lanes = {
            "in-process": in_process,
            "grpc": lambda: runner().wall_s,
            "grpc, client thread": lambda: in_thread().wall_s,
        }
        first = {name: lane() for name, lane in lanes.items()}
        print("first calls: " + ", ".join(f"{k} {v:.3f} s" for k, v in first.items()))
        times: dict[str, list[float]] = {name: [] for name in lanes}
        for index in range(args.small_rounds):
            if budget.left() < args.lane_reserve_s:
                break
            order = list(lanes) if index % 2 == 0 else list(reversed(lanes))
            for name in order:
                times[name].append(lanes[name]())
            local = times["in-process"][-1]
            print(f"round {index}: " + ", ".join(
                f"{name} {t[-1]:.3f} s ({t[-1] / local:.3f})" for name, t in times.items()
            ), flush=True)  # fmt: skip
        if times["in-process"]:
            medians = {name: statistics.median(t) for name, t in times.items()}
            local = medians["in-process"]
            print("medians: " + ", ".join(f"{k} {v:.3f} s" for k, v in medians.items())
                  + f"; gRPC / in-process {medians['grpc'] / local:.3f} (target <= 1.05), "
                  f"client thread / in-process {medians['grpc, client thread'] / local:.3f}",
                  flush=True)  # fmt: skip
    except Exception as error:  # noqa: BLE001 - the run ends with what it has
        print(failure(error), flush=True)
    finally:
        runner.close()
        in_thread.close()
        server.stop(0)


# ---- the run ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="a small model and batch (smoke test)")
    parser.add_argument(
        "--model", default=GPU_BENCH_MODEL, choices=sorted(QWEN2_05B_VOCAB),
        help="the Qwen2-0.5B shape by vocabulary (bench_generation.QWEN2_05B_VOCAB): 0.5b-issue "
        "is the issue's case, 0.5b the model of the figures before 2026-11-27",
    )  # fmt: skip
    parser.add_argument("--reps", type=int, default=3, help="steady calls per lane")
    parser.add_argument(
        "--hf-reps",
        type=int,
        default=2,
        help="steady HF generate calls (the baseline: a single call varied 4.6-5.0 s)",
    )
    parser.add_argument(
        "--all-lanes", action="store_true", help="also batch 32, and graphs-only and eager lanes"
    )
    parser.add_argument(
        "--skip", default="", help="comma list of: generation, scoring, e2e, grpc, small"
    )
    parser.add_argument("--small-rounds", type=int, default=3, help="rounds of the small request")
    parser.add_argument("--budget-s", type=float, default=290.0, help="the whole run")
    parser.add_argument("--lane-budget-s", type=float, default=60.0, help="no new call after")
    parser.add_argument("--lane-reserve-s", type=float, default=15.0, help="skip a lane below")
    parser.add_argument("--server-start-s", type=float, default=240.0)
    parser.add_argument(
        "--grpc-reserve-s", type=float, default=75.0,
        help="seconds the diagnostic lanes (scoring, engine thread, grpc in this process) leave "
        "to the gRPC lane to a server process: the lane of the issue's ratios",
    )  # fmt: skip
    parser.add_argument("--kv-cache-tokens", type=int, default=0, help="0: the server default")
    args = parser.parse_args(argv)
    args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    args.skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available: nothing to measure (try --device cpu --quick).")
        return 0
    budget = Budget(args.budget_s)
    dtype = getattr(torch, args.dtype)
    size = "small" if args.quick else args.model
    start = time.perf_counter()
    model = build_model(size, 512, 64, 2, dtype, args.device)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"device {name}, torch {torch.__version__}, model {size} {dtype} "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, vocab "
          f"{model.config.vocab_size}), built in {time.perf_counter() - start:.1f} s",
          flush=True)  # fmt: skip
    rates: dict[tuple[str, str], float] = {}
    if "generation" not in args.skip:
        header = ["case", "lane", "tokens/s", "first s", "steady s (n)", "peak alloc/reserved",
                  "vs hf"]  # fmt: skip
        print("\n## Generation (tokens per call = rows x new tokens; steady = median)\n")
        print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header), flush=True)
        for case in generation_cases(args.quick, args.all_lanes):  # rows print as measured
            run_generation_case(model, case, args, budget, rates)
    if "scoring" not in args.skip:
        scoring_section(model, args, budget)
    case, batching = end_to_end_case(args.quick)
    work = None
    try:
        work = scoring_work(model, case, args.device)
    except Exception as error:  # noqa: BLE001 - a figure of the summary, not a lane
        print(f"scoring work: {failure(error)}", flush=True)
    lanes: dict[str, Lane] = {}
    server = ServerFigures(Lane("grpc", error="skipped"))
    with tempfile.TemporaryDirectory(prefix="bench-gpu-model-") as tmp:
        directory = save_checkpoint(model, Path(tmp))
        config = model.config
        del model  # the servers load their own copies; free this one's memory and graphs
        gc.collect()
        reset_memory(args.device)
        header = ["lane", "tokens/s", "first s", "phases of the first (s)",
                  "steady s (this process's CPU s)", "phases of the best (s)",
                  "outside phases s", "notes"]  # fmt: skip
        print(f"\n## MakeExperience end to end ({case.prompts} prompts x {case.samples}, "
              f"{case.prompt_len}-token prompts, {case.new_tokens} new tokens; rows per "
              f"generate/forward/micro-batch {batching.generate}/{batching.forward}/"
              f"{batching.micro})\n")  # fmt: skip
        print("| " + " | ".join(header) + " |\n|" + " --- |" * len(header), flush=True)
        if "e2e" not in args.skip:
            try:
                for lane in in_process_lanes(directory, case, batching, args, budget):
                    lanes[lane.name] = lane
            except Exception as error:  # noqa: BLE001
                print_lane(Lane("in-process", error=failure(error)), case)
            gc.collect()
            reset_memory(args.device)
        if "grpc" not in args.skip:
            server = grpc_lane(directory, case, batching, args, budget)
    print_summary(case, rates, lanes, server, kv_bytes_of_batch(config, case, dtype.itemsize))
    print_scoring_room(case, rates, server.lane, work)
    if "small" not in args.skip:
        gc.collect()
        reset_memory(args.device)
        small_request(args, budget)
    print(f"\nrun took {args.budget_s - budget.left():.0f} s", flush=True)
    budget.cancel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
