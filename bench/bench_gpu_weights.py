"""UpdateWeights into a CUDA bfloat16 server, per transport, against the copies it cannot beat.

The model is a random Qwen2-0.5B-shaped model of bench_generation.py (no download; by default
issue 20's: vocab 32,000, tied embeddings, 386M parameters, 0.83 GB per update), saved to a
temp dir and served by `rollserve serve --device cuda --dtype bfloat16 --generation-path hf` (a
subprocess on a free port; the hf path skips the engine's compile, which this bench does not
measure). The trainer is this process. Measured in the same run:

* ceilings: a pinned host -> device memcpy of the file's bytes (what any host path must do last)
  and a device -> device copy of them (what cuda_ipc must do), best of 3 each;
* lanes, each one warm-up update then best of 3, applied GB/s = file bytes / wall seconds of
  `update_weights` (until the server replied: received, verified, swapped in): cuda_ipc (CUDA
  tensors, one handle per tensor; flattened by flatten_weights, one handle; flattened with
  the tied weight one tensor under both names, as a trainer holds it; the per-tensor
  ones with pack=True, copied into one buffer of the client first; ratio to the device copy),
  shm (CPU tensors; CUDA tensors; CPU tensors that live in the client's memfd,
  client.share_weights: only the server's copy), grpc (CPU tensors) and dist (a gloo
  WeightsGroup, CPU tensors), each host lane with its ratio to the pinned copy;
* a CPU server of the same model (unless --no-cpu-reference): grpc and dist into it, so that
  the GPU server's host lanes can be compared with what the same lanes do into host memory;
* on a node with two GPUs or more: a server on cuda:1 and the trainer's tensors on cuda:0,
  dist over an NCCL WeightsGroup (per tensor, and flattened: plain slices of one run) and
  cuda_ipc of the flattened weights across the two GPUs, against a cuda:0 -> cuda:1 copy of
  the same bytes ("P2P"); one GPU prints the lanes as skipped.

Targets (issue 20, one H100): cuda_ipc >= 0.3 x device copy, shm >= 0.5 x pinned copy, grpc and
dist no slower than into the CPU server. A failing lane prints its error; the run goes on.

Each lane also says where the server staged it ("staged"): the server runs at --log-level INFO
and its arena logs where each staging buffer it allocates lives (weights/arena.py: on the
device, or in pinned host memory, with a warning when the device had no room); the lane's
column is the last such buffer, plus any fallback warning logged during the lane. The server
also logs one line per update with its phases (weights/timings.py: head, open, receive, finish,
swap_wait, apply, close, ... and the lanes' summed seconds of ring waits, host copies, copy and
check launches); each lane prints the phases of its best round ("phases v<version>") and the
median of its rounds per phase, and the table's last column names its largest phase. The "grpc"
lane asks for transport="grpc": the client may split it over parallel streams (it does on a
many-core node), which the server reports as "grpc-parallel"; the note says which carried it.

    python bench/bench_gpu_weights.py                       # a CUDA node, under 2 minutes
    python bench/bench_gpu_weights.py --quick --device cpu  # a smoke test here (< 1 minute)
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "tests"))
from bench_generation import GPU_BENCH_MODEL, QWEN2_05B_VOCAB, build_model  # noqa: E402
from bench_gpu import environment  # noqa: E402
from helpers_server import start_server_process  # noqa: E402
from rollserve.client import RolloutClient, WeightsGroup  # noqa: E402
from rollserve.client.weights.flat_weights import flatten_weights  # noqa: E402
from rollserve.client.weights.shared_memory import WRITE_THREADS_ENV  # noqa: E402
from rollserve.client.weights.upload import CUDA_IPC_CLIENT_LINE  # noqa: E402
from rollserve.server.models.loading import FLAT_WEIGHTS_ENV  # noqa: E402
from rollserve.server.weights.cuda_ipc import IN_PLACE_ENV  # noqa: E402

ROUNDS = 3
# --baseline: the lever a second server runs with off, for the cuda_ipc flat lane.
BASELINES = {"staged": (IN_PLACE_ENV, "0"), "per-tensor": (FLAT_WEIGHTS_ENV, "0")}
WAIT_S = 120.0
# Threads of the host copy ceilings: the shm client's writers (client/weights/shared_memory.py:
# 4 by default) against one and twice as many.
HOST_COPY_THREADS = (1, 4, 8)
# Issue 20's targets: the lane's ratio to its ceiling ("cpu": to the same lane into a CPU server).
TARGETS = {"cuda_ipc": 0.3, "shm": 0.5, "grpc": 1.0, "dist": 1.0}
# What the server may answer for a transport asked for: the client carries "grpc" over parallel
# streams when the host has the cores for it, and the server then names it "grpc-parallel".
CARRIED_AS = {"grpc": ("grpc", "grpc-parallel")}
# The server's arena log (weights/arena.py): where a staging buffer was allocated, and why an
# update staged on the host when the device had no room or its allocation failed.
_BUFFER = re.compile(r"staging buffer of (\d+) bytes (on \S+|in pinned host memory|in host memory)")
_FALLBACK = re.compile(r"staging \d+ bytes on \S+ (does not fit|failed)")
# The server's line per update (weights/update.py): its version and its phases (timings.py).
_STAGED_IN_PLACE = re.compile(r"updated \S+ to version \d+ over \S+: .*?; staged in place;")
_PHASES = re.compile(r"updated \S+ to version (\d+) over \S+: .*?; phases: (.*)$", re.MULTILINE)
_PHASE = re.compile(r"([a-z_]+) ([0-9.]+)")


@dataclass
class Row:
    lane: str
    tensors: str  # where the trainer's tensors are
    gbps: float | None = None  # best of ROUNDS
    server_s: float | None = None  # the server's seconds (header to swap) of the best round
    ceiling: str = ""
    ratio: float | None = None
    target: str = ""
    staged: str = ""  # where the server staged the lane's updates (its log)
    note: str = ""
    largest: str = ""  # the largest server phase of the best round (its log)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        for index in range(torch.cuda.device_count()):  # a P2P copy involves two
            torch.cuda.synchronize(index)


def best_copy_gbps(source: torch.Tensor, target: torch.Tensor, device: str) -> float:
    """Best of ROUNDS of one copy of `source` into `target` (bytes copied / second)."""
    best = 0.0
    for _ in range(ROUNDS + 1):  # the first warms the copy engines up
        _sync(device)
        started = time.perf_counter()
        target.copy_(source, non_blocking=True)
        _sync(device)
        best = max(best, source.numel() / (time.perf_counter() - started) / 1e9)
    return best


def save_actor(directory: Path, size: str) -> dict[str, torch.Tensor]:
    """The random model (bfloat16) and the byte tokenizer in `directory`; its state dict (CPU):
    a tied model's shared tensor under both its names, as a trainer's state_dict() has it."""
    from rollserve.server.models.default_model import build_byte_tokenizer

    model = build_model(size, 4096, 256, 2, torch.bfloat16, "cpu")
    model.config.bos_token_id, model.config.eos_token_id = 1, 2
    model.save_pretrained(directory)
    build_byte_tokenizer().save_pretrained(directory)
    return {name: t.detach().contiguous() for name, t in model.state_dict().items()}


def tied_on_cuda(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` on CUDA with each tied weight (names whose tensors share memory) one tensor
    under all its names, as a trainer's model.state_dict(keep_vars=True) has it."""
    copies: dict[tuple, torch.Tensor] = {}
    tied = {}
    for name, tensor in weights.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if key not in copies:
            copies[key] = tensor.cuda()
        tied[name] = copies[key]
    return tied


def staged_where(log: str, lane_start: int) -> str:
    """Where the server's arena stages now (its last buffer in `log`), and the fallback warnings
    it logged since `lane_start` (an offset into `log`); "?" without a buffer line."""
    buffers = _BUFFER.findall(log)
    where = "?" if not buffers else buffers[-1][1].removeprefix("on ").removeprefix("in ")
    if _STAGED_IN_PLACE.search(log, lane_start):  # the lane's updates took no staging buffer
        where = "in place"
    fallbacks = sorted({match.group(1) for match in _FALLBACK.finditer(log, lane_start)})
    return where if not fallbacks else f"{where} (device {', '.join(fallbacks)})"


def update_phases(log: str, lane_start: int) -> dict[int, str]:
    """The phases line (timings.py) of every update the server logged since `lane_start`, by
    version."""
    return {int(m.group(1)): m.group(2) for m in _PHASES.finditer(log, lane_start)}


def phase_seconds(line: str) -> dict[str, float]:
    """The phases of one phases line (before its lane-seconds), in seconds."""
    return {name: float(value) for name, value in _PHASE.findall(line.split(" = ")[0])}


def print_phases(lines: dict[int, str], best_version: int, label: str) -> str:
    """Print the best round's phases line and each phase's median over the rounds; the best
    round's largest phase ("" without its line)."""
    best = lines.get(best_version)
    if best is None:
        print(f"    {label} phases: no line for v{best_version} in the server's log", flush=True)
        return ""
    print(f"    {label} phases v{best_version}: {best}", flush=True)
    rounds = [phase_seconds(line) for line in lines.values()]
    names = list(phase_seconds(best))
    medians = {n: sorted(r.get(n, 0.0) for r in rounds)[len(rounds) // 2] for n in names}
    print(f"    {label} median of {len(rounds)}: "
          + " ".join(f"{n} {s:.4f}" for n, s in medians.items()), flush=True)  # fmt: skip
    seconds = phase_seconds(best)
    name = max(seconds, key=seconds.__getitem__)
    return f"{name} {seconds[name]:.3f} s"


class ClientLines(logging.Handler):
    """The client's debug line of each cuda_ipc update (weights/upload.py), by version: where
    the client's part of the update goes (export and head, the call)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.by_version: dict[int, str] = {}
        logger = logging.getLogger("rollserve.client.weights.upload")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == CUDA_IPC_CLIENT_LINE and isinstance(record.args, tuple):
            self.by_version[int(record.args[0])] = record.getMessage()  # args[0]: the version


CLIENT_LINES = ClientLines()


class Trainer:
    """This process as the trainer of one server: versions rise by one per update."""

    def __init__(self, target: str, log: Callable[[], str] = str) -> None:
        # log: the server's log so far (staged_where reads it).
        self.client = RolloutClient(target, timeout_s=WAIT_S)
        self.version = self.client.health().policy_version
        self.best_version = self.version  # the version of the last lane's best round
        self.log = log

    def best_gbps(
        self, send: Callable[[int], object], total_bytes: int
    ) -> tuple[float, float, str]:
        """One warm-up update, then best of ROUNDS: GB/s, the server's seconds of that round,
        the reply's transport."""
        best, server_s, transport = 0.0, 0.0, ""
        for round_ in range(ROUNDS + 1):
            self.version += 1
            started = time.perf_counter()
            result = send(self.version)
            seconds = time.perf_counter() - started
            transport = result.transport  # type: ignore[attr-defined]
            if round_ and total_bytes / seconds / 1e9 > best:
                best = total_bytes / seconds / 1e9
                server_s = result.server_seconds  # type: ignore[attr-defined]
                self.best_version = self.version
        return best, server_s, transport

    def lane(
        self,
        weights: dict[str, torch.Tensor],
        transport: str,
        total_bytes: int,
        *,
        backend: str = "gloo",
        flat: bool = False,
        pack: bool = False,
    ) -> tuple[float, float, str, str, str]:
        """GB/s, the server's seconds, the transport that carried it, where it staged, its best
        round's largest phase (the phases are printed). dist: over a WeightsGroup of `backend`,
        the weights flattened by it first with `flat`."""
        lane_start = len(self.log())
        warm_up = self.version + 1  # its line is left out of the medians
        if transport == "dist":
            with WeightsGroup([self.client], backend=backend, timeout_s=WAIT_S) as group:
                if flat:
                    group.flatten_weights(weights)
                gbps, server_s, sent_as = self.best_gbps(
                    lambda v: self.client.update_weights(weights, version=v, group=group),
                    total_bytes,
                )
        else:
            gbps, server_s, sent_as = self.best_gbps(
                lambda v: self.client.update_weights(
                    weights, version=v, transport=transport, pack=pack
                ),
                total_bytes,
            )
        if sent_as not in CARRIED_AS.get(transport, (transport,)):
            raise RuntimeError(f"asked for {transport}, the server says {sent_as}")
        log = self.log()
        lines = {v: line for v, line in update_phases(log, lane_start).items() if v != warm_up}
        largest = print_phases(lines, self.best_version, transport)
        if transport == "cuda_ipc":
            client_line = CLIENT_LINES.by_version.get(self.best_version, "no line")
            print(f"    {transport} client, best round: {client_line}", flush=True)
        wall_s = total_bytes / (gbps * 1e9) if gbps else 0.0
        print(
            f"    {transport} best round: {wall_s:.4f} s in update_weights = server "
            f"{server_s:.4f} s (turn to close) + {wall_s - server_s:.4f} s outside it (the "
            "client's export and calls, the RPC, the header's and reply's trips)",
            flush=True,
        )
        return gbps, server_s, sent_as, staged_where(log, lane_start), largest

    def close(self) -> None:
        self.client.close()


def run_lane(
    row: Row,
    measure: Callable[[], tuple[float, float, str, str, str]],
    ceiling: float | None = None,
) -> None:
    """Fill row.gbps (and its ratio to `ceiling`), or its note with the error; print the row
    at once either way (a run cut short keeps what it printed)."""
    try:
        row.gbps, row.server_s, sent_as, row.staged, row.largest = measure()
        if sent_as != row.lane:
            row.note = f"carried by {sent_as} {row.note}".strip()
    except Exception as error:
        row.note = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
        traceback.print_exc(file=sys.stderr)
    if row.gbps is not None and ceiling:
        row.ratio = row.gbps / ceiling
    ratio = "" if row.ratio is None else f" = {row.ratio:.3f} x {row.ceiling}"
    server = "" if row.server_s is None else f" (server {row.server_s:.3f} s)"
    staged = f" staged: {row.staged}" if row.staged else ""
    print(f"  {row.lane} ({row.tensors}): {_cell(row.gbps)} GB/s{ratio}{server}{staged} "
          f"{row.note}", flush=True)  # fmt: skip


def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--quick", action="store_true", help="a small Llama (smoke test)")
    parser.add_argument(
        "--model", default=GPU_BENCH_MODEL, choices=sorted(QWEN2_05B_VOCAB),
        help="the Qwen2-0.5B shape by vocabulary (bench_generation.QWEN2_05B_VOCAB): 0.5b-issue "
        "(0.83 GB per update with lm_head under its tied name) is issue 20's case, 0.5b (1.26 "
        "GB) the model of the figures before 2026-11-27",
    )  # fmt: skip
    parser.add_argument("--no-cpu-reference", action="store_true")
    parser.add_argument(
        "--baseline",
        action="append",
        choices=sorted(BASELINES),
        default=[],
        help="also the cuda_ipc flat lane into a second server with a lever off: 'staged' "
        "(ROLLSERVE_CUDA_IPC_IN_PLACE=0: every update staged in the arena), 'per-tensor' "
        "(ROLLSERVE_FLAT_WEIGHTS=0: the model's weights an allocation each, so the apply is a "
        "copy per tensor); repeatable",
    )
    parser.add_argument(
        "--staged-baseline", action="store_true", help="the same as --baseline staged"
    )
    args = parser.parse_args(argv)
    if args.staged_baseline and "staged" not in args.baseline:
        args.baseline.append("staged")
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (--quick --device cpu runs the smoke test)")
        return 0
    on_cuda = device == "cuda"
    started = time.monotonic()
    label = torch.cuda.get_device_name(0) if on_cuda else "cpu"
    print(f"device: {label}; torch {torch.__version__}")
    rows: list[Row] = []
    servers = []
    ceilings: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory(prefix="rollserve-gpu-weights-") as tmp:
        weights = save_actor(Path(tmp), "small" if args.quick else args.model)
        total_bytes = sum(t.nbytes for t in weights.values())  # the data section; + a few KiB
        parameters = sum(t.numel() for t in weights.values())
        print(f"model: {parameters / 1e6:.0f}M parameters, {total_bytes / 1e9:.2f} GB bfloat16, "
              f"built in {time.monotonic() - started:.0f} s")  # fmt: skip
        common = ("--dtype", "bfloat16", "--actor", tmp, "--generation-path", "hf",
                  "--log-level", "INFO", "--metrics-port", "0")  # fmt: skip
        try:
            proc, port = start_server_process("--device", device, *common, timeout_s=WAIT_S)
            servers.append(proc)
            print(f"server ({device}) serving after {time.monotonic() - started:.0f} s")
            ceilings = measure_ceilings(total_bytes, on_cuda)
            for name, gbps in ceilings.items():
                print(f"ceiling {name}: {_cell(gbps)} GB/s", flush=True)
            trainer = Trainer(f"127.0.0.1:{port}", proc.log_text)
            rows += gpu_server_lanes(trainer, weights, total_bytes, ceilings, on_cuda)
            trainer.close()
            for baseline in args.baseline if on_cuda else ():
                proc.terminate_and_wait()  # one 0.5B server on the GPU at a time
                env = dict([BASELINES[baseline]])
                proc, port = start_server_process(
                    "--device", device, *common, env=env, timeout_s=WAIT_S
                )
                servers.append(proc)
                other = Trainer(f"127.0.0.1:{port}", proc.log_text)
                rows += baseline_lane(baseline, other, weights, total_bytes, ceilings)
                other.close()
            if on_cuda:
                rows += two_gpu_lanes(common, weights, total_bytes, servers)
            if on_cuda and not args.no_cpu_reference:
                proc, port = start_server_process("--device", "cpu", *common, timeout_s=WAIT_S)
                servers.append(proc)
                reference = Trainer(f"127.0.0.1:{port}", proc.log_text)
                rows += cpu_reference_lanes(reference, weights, total_bytes, rows)
                reference.close()
        finally:
            for proc in servers:
                proc.terminate_and_wait()
    print()
    print(f"UpdateWeights into a {device} bfloat16 server ({label}), best of {ROUNDS}, "
          f"{total_bytes / 1e9:.2f} GB per update:")  # fmt: skip
    for name, gbps in ceilings.items():
        print(f"- ceiling {name}: {_cell(gbps)} GB/s")
    print()
    print("| lane | trainer's tensors | applied GB/s | server s | ratio | to | target | staged "
          "| note | largest server phase |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row.lane} | {row.tensors} | {_cell(row.gbps)} | {_cell(row.server_s, 3)} | "
              f"{_cell(row.ratio)} | {row.ceiling} | {row.target} | {row.staged} | "
              f"{row.note} | {row.largest} |")  # fmt: skip
    print(
        '\ngrpc: transport="grpc", which the client may carry over parallel streams (the '
        "server then says grpc-parallel, named in the note). staged: where the server's "
        "arena staged the lane's updates, read from its log (in brackets: a device fallback "
        "warning of the lane)."
    )
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    return 0


def host_copy_gbps(total_bytes: int, threads: int) -> float:
    """Best of ROUNDS of one host copy of `total_bytes` into a page-locked buffer (pinned when
    CUDA is there) by `threads` numpy threads, each a contiguous share: what the shm client's
    writing threads can do at most (they copy CPU tensors with numpy into a page-locked memfd)."""
    from concurrent.futures import ThreadPoolExecutor

    source = torch.ones(total_bytes, dtype=torch.uint8).numpy()
    target = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    target_array = target.numpy()
    target_array[:] = 0  # every page touched before the timed copies
    bounds = [total_bytes * i // threads for i in range(threads + 1)]
    shares = list(zip(bounds, bounds[1:], strict=False))

    def copy(share: tuple[int, int]) -> None:
        np.copyto(target_array[share[0] : share[1]], source[share[0] : share[1]])

    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(ROUNDS + 1):
            started = time.perf_counter()
            list(pool.map(copy, shares))
            best = max(best, total_bytes / (time.perf_counter() - started) / 1e9)
    return best


def measure_ceilings(total_bytes: int, on_cuda: bool) -> dict[str, float | None]:
    """Host copies of the file's bytes by 1, 4 and 8 threads; pinned host -> device and device
    -> device copies of them (None off CUDA)."""
    host = {f"host copy, {n} threads": host_copy_gbps(total_bytes, n) for n in HOST_COPY_THREADS}
    if not on_cuda:
        return {**host, "pinned H2D": None, "D2D": None}
    pinned = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=True)
    first = torch.empty(total_bytes, dtype=torch.uint8, device="cuda")
    second = torch.empty_like(first)
    ceilings = {
        **host,
        "pinned H2D": best_copy_gbps(pinned, first, "cuda"),
        "D2D": best_copy_gbps(first, second, "cuda"),
    }
    del pinned, first, second
    torch.cuda.empty_cache()
    return ceilings


def gpu_server_lanes(
    trainer: Trainer,
    weights: dict[str, torch.Tensor],
    total_bytes: int,
    ceilings: dict[str, float | None],
    on_cuda: bool,
) -> list[Row]:
    print("lanes:", flush=True)
    cuda_weights = {k: v.cuda() for k, v in weights.items()} if on_cuda else None
    flat_weights = flat_tied = None
    if cuda_weights is not None:  # one buffer laid out like the data section: one handle
        flat_weights = {k: v.clone() for k, v in cuda_weights.items()}
        flatten_weights(flat_weights)
        # A trainer's tied weight is one tensor under both names: flattened, its second name
        # is a shadow the export refreshes (flat_weights.py), so still one span, in place.
        flat_tied = tied_on_cuda(weights)
        flatten_weights(flat_tied)
    lanes = [
        ("cuda_ipc", "CUDA", "D2D"),
        ("cuda_ipc", "CUDA, flat", "D2D"),
        ("cuda_ipc", "CUDA, flat, tied as one tensor", "D2D"),
        ("cuda_ipc", "CUDA, pack=True", "D2D"),
        ("shm", "CPU", "pinned H2D"),
        ("shm", "CPU, 8 write threads", "pinned H2D"),
        ("shm", "CUDA", "pinned H2D"),
        ("shm", "CPU, share_weights", "pinned H2D"),
        ("grpc", "CPU", "pinned H2D"),
        ("dist", "CPU", "pinned H2D"),
    ]
    rows = []
    for transport, where, ceiling in lanes:
        row = Row(transport, where, ceiling=ceiling, target=f">= {TARGETS[transport]}")
        if transport in ("grpc", "dist"):
            row.target = f"{row.target} x into a cpu server"
        rows.append(row)
        if where.startswith("CUDA") and cuda_weights is None:
            row.note = "skipped: needs CUDA"
            print(f"  {transport} ({where}): skipped (needs CUDA)", flush=True)
            continue
        tensors = {"CUDA": cuda_weights, "CUDA, flat": flat_weights,
                   "CUDA, flat, tied as one tensor": flat_tied,
                   "CUDA, pack=True": cuda_weights}.get(where, weights)  # fmt: skip
        if where == "CPU, share_weights":  # the tensors live in the client's memfd: no copy
            tensors = {k: v.clone() for k, v in weights.items()}
            trainer.client.share_weights(tensors)
        assert tensors is not None
        limit = ceilings.get(ceiling)
        pack = where.endswith("pack=True")  # copied into one buffer of the client first
        threads = "8" if where.endswith("8 write threads") else None
        with environment(WRITE_THREADS_ENV, threads):  # the client reads it at each write
            run_lane(
                row,
                lambda t=transport, w=tensors, p=pack: trainer.lane(w, t, total_bytes, pack=p),
                limit,
            )
    return rows


def two_gpu_lanes(
    common: tuple[str, ...], weights: dict[str, torch.Tensor], total_bytes: int, servers: list
) -> list[Row]:
    """A server on cuda:1, the trainer's tensors on cuda:0 (the module's last lanes)."""
    rows = [
        Row("dist", "cuda:0 -> cuda:1, NCCL", ceiling="P2P", target="-"),
        Row("dist", "cuda:0 -> cuda:1, NCCL, flat", ceiling="P2P", target="-"),
        Row("cuda_ipc", "cuda:0 -> cuda:1, flat", ceiling="P2P", target="-"),
    ]
    if torch.cuda.device_count() < 2:
        print("two-GPU lanes: skipped (one GPU)", flush=True)
        for row in rows:
            row.note = "skipped: needs 2 GPUs"
        return rows
    print("two GPUs: server on cuda:1, trainer on cuda:0:", flush=True)
    proc, port = start_server_process("--device", "cuda:1", *common, timeout_s=WAIT_S)
    servers.append(proc)
    torch.cuda.set_device(0)  # NCCL's rank 0 (the trainer) on cuda:0
    source = torch.empty(total_bytes, dtype=torch.uint8, device="cuda:0")
    target = torch.empty(total_bytes, dtype=torch.uint8, device="cuda:1")
    peer = best_copy_gbps(source, target, "cuda")
    del source, target
    print(f"ceiling P2P (cuda:0 -> cuda:1): {_cell(peer)} GB/s", flush=True)
    trainer = Trainer(f"127.0.0.1:{port}", proc.log_text)
    try:
        on_first = {k: v.to("cuda:0") for k, v in weights.items()}
        run_lane(rows[0], lambda: trainer.lane(on_first, "dist", total_bytes, backend="nccl"), peer)
        flat = {k: v.clone() for k, v in on_first.items()}
        run_lane(
            rows[1],
            lambda: trainer.lane(flat, "dist", total_bytes, backend="nccl", flat=True),
            peer,
        )
        ipc_flat = {k: v.clone() for k, v in on_first.items()}
        flatten_weights(ipc_flat)
        run_lane(rows[2], lambda: trainer.lane(ipc_flat, "cuda_ipc", total_bytes), peer)
    finally:
        trainer.close()
    return rows


def baseline_lane(
    baseline: str,
    trainer: Trainer,
    weights: dict[str, torch.Tensor],
    total_bytes: int,
    ceilings: dict[str, float | None],
) -> list[Row]:
    """The cuda_ipc flat lane into a server with one lever off (BASELINES): what staging in
    place saves (server/weights/cuda_ipc.py), or what the one buffer in the file's order saves
    (server/models/memory.py, weights/copy_runs.py)."""
    env, value = BASELINES[baseline]
    print(f"cuda_ipc flat into a server with {env}={value}:", flush=True)
    flat = {k: v.cuda() for k, v in weights.items()}
    flatten_weights(flat)
    row = Row("cuda_ipc", "CUDA, flat", ceiling="D2D", target=f">= {TARGETS['cuda_ipc']}",
              note=f"{env}={value} (baseline)")  # fmt: skip
    run_lane(row, lambda: trainer.lane(flat, "cuda_ipc", total_bytes), ceilings.get("D2D"))
    return [row]


def cpu_reference_lanes(
    reference: Trainer, weights: dict[str, torch.Tensor], total_bytes: int, rows: list[Row]
) -> list[Row]:
    """grpc and dist into a CPU server; the GPU server's rows of them get their ratio to it."""
    print("the same lanes into a CPU server:", flush=True)
    added = []
    for transport in ("grpc", "dist"):
        row = Row(transport, "CPU", ceiling="-", note="into a CPU server (reference)")
        run_lane(row, lambda t=transport: reference.lane(weights, t, total_bytes))
        added.append(row)
        for gpu_row in rows:
            if gpu_row.lane == transport and gpu_row.gbps is not None and row.gbps:
                gpu_row.note = (f"{gpu_row.note} {gpu_row.gbps / row.gbps:.2f} x cpu server "
                                f"({row.gbps:.2f} GB/s)").strip()  # fmt: skip
    return added


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
