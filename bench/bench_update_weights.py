"""UpdateWeights applied GB/s per data plane against raw TCP loopback GB/s, in interleaved rounds.

Each round measures, one after the other:

* raw TCP: a sender process `sendall`s 4 MiB blocks (~1 GiB in all) over 127.0.0.1 to a
  receiver process that `recv_into`s a preallocated buffer and acks the last byte; the clock runs
  in the sender from the first byte to the ack (both buffers stay in the CPU cache);
* memcpy: one warm DRAM-to-DRAM copy of a file-sized buffer by 2 numpy threads, the ceiling of
  any plane that must copy the file once; and, with "dist", gloo broadcasting the file to one
  receiver process (nothing of rollserve): "gloo", one process group and 16 MiB broadcasts one
  at a time, and "gloo-lanes", two groups of 32 MiB broadcasts, two in flight each (the
  schedule of dist-flat), the ceilings of those planes;
* UpdateWeights, one lane per data plane, each to its own `rollserve serve` subprocess: a client
  process pushes the whole state dict of a random Llama (~120M parameters, float32, built from
  a config and saved to a temp dir); the clock runs from the call to the server's reply, i.e.
  until the new weights are applied (received, verified and swapped in on the engine thread).
  Lanes: grpc (one stream, 1 MiB chunks, no CRC), grpc-parallel (--streams streams), shm (the
  client copies the tensors into its memfd while the server copies behind it: two copies),
  shm-shared (`client.share_weights`: the tensors live in the memfd, only the server's copy),
  dist (a gloo broadcast through a WeightsGroup, from the state dict's own tensors), dist-flat
  (the same after `WeightsGroup.flatten_weights`: the tensors live in one buffer laid out like
  the data section, broadcast in plain bucket-sized slices);
* the grpc client pushing the same file to a drain-only gRPC server (parses each message with
  rollserve's wire parser, client/wire.py, and drops it): the ceiling that the client and gRPC
  allow, which splits the gap to raw TCP into the client's share and the server's.

The headline is the median of the per-round ratios (this VM drifts by +-20 % from minute to
minute, so only paired ratios are stable; docs/reference/transport.md). Targets (issue 11):
shm >= 1.5 x raw TCP, dist >= 0.6 x raw TCP, grpc >= 0.8 x the drain-only server. We also
print each lane's ratio to memcpy, the end-to-end seconds of its first (cold) update and of
the warm ones, CPU seconds per GiB on both sides, and each server's resident memory: after
loading, and its peak during each update (VmHWM, reset before each update through
/proc/<pid>/clear_refs; for shm it includes the client's memfd pages the server maps).

Every process runs with the tuned malloc environment of docs/reference/transport.md
(MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_TOP_PAD_=67108864):
the script re-executes itself with it unless --default-malloc is given.

    python bench/bench_update_weights.py                  # ~4 minutes on 2 cores
    python bench/bench_update_weights.py --wait-quiet 1.5 # first wait for a quiet machine
    python bench/bench_update_weights.py --rounds 3 --hidden 256 --layers 4 --vocab 8192
    python bench/bench_update_weights.py --transports shm,shm-shared,dist,dist-flat
    python bench/bench_update_weights.py --transports dist --dist-lanes 1   # one gloo lane
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import platform
import resource
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

TUNED_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": "33554432",
    "MALLOC_TRIM_THRESHOLD_": "1073741824",
    "MALLOC_TOP_PAD_": "67108864",
}
MIB = 1 << 20
GIB = 1 << 30
TCP_BLOCK_BYTES = 4 * MIB
# The dist planes' ceilings, measured in the same rounds (GlooCeiling: process groups, bytes
# per broadcast, in flight per group). "gloo": the plain loop, one group, 16 MiB (faster than
# 4 MiB: 2.6-3.0 GB/s against 2.3-2.8). "gloo-lanes": the flat plane's schedule, gloo's best
# here (2 groups of 32 MiB broadcasts: 3.6-4.9 GB/s in a side experiment, 1 group 3.2-3.6).
GLOO_CEILINGS = {"gloo": (1, 16 * MIB, 1), "gloo-lanes": (2, 32 * MIB, 2)}
PROBE_SETTLE_S = 0.3
_TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"


# ---- raw TCP ----------------------------------------------------------------------------------


def _tcp_receiver(port_out: Connection, total_bytes: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port_out.send(listener.getsockname()[1])
        conn, _ = listener.accept()
    buffer = memoryview(bytearray(TCP_BLOCK_BYTES))  # preallocated, reused for every block
    received = 0
    with conn:
        while received < total_bytes:
            filled = 0
            want = min(TCP_BLOCK_BYTES, total_bytes - received)
            while filled < want:
                got = conn.recv_into(buffer[filled:want])
                if not got:
                    raise ConnectionError("sender closed early")
                filled += got
            received += filled
        conn.sendall(b"k")


def _tcp_sender(port: int, total_bytes: int, result: Connection) -> None:
    block = memoryview(os.urandom(TCP_BLOCK_BYTES))
    with socket.create_connection(("127.0.0.1", port)) as conn:
        started_s = time.perf_counter()
        sent = 0
        while sent < total_bytes:
            take = min(TCP_BLOCK_BYTES, total_bytes - sent)
            conn.sendall(block[:take])
            sent += take
        if conn.recv(1) != b"k":
            raise ConnectionError("no ack")
        result.send(time.perf_counter() - started_s)


def memcpy_gbps(buffers: tuple, threads: int = 2) -> float:
    """One warm DRAM-to-DRAM copy of a file-sized buffer by `threads` numpy threads: the most a
    data plane that copies the file once (shared memory) can reach on this machine."""
    import threading

    import numpy as np

    source, destination = buffers
    size = len(source)
    cuts = [size * i // threads // 64 * 64 for i in range(threads)] + [size]
    workers = [
        threading.Thread(target=np.copyto, args=(destination[a:b], source[a:b]))
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    started_s = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return size / (time.perf_counter() - started_s) / 1e9


def _gloo_receiver(port: int, total_bytes: int, shape: tuple[int, int, int], rounds: int) -> None:
    import torch
    from rollserve.client.protocol.process_group import new_process_groups

    lanes, bucket_bytes, in_flight = shape
    groups = new_process_groups(group="ceiling", master_address="127.0.0.1", master_port=port,
                                world_size=2, rank=1, backend="gloo", timeout_s=120.0,
                                lanes=lanes)  # fmt: skip
    buffer = torch.empty(total_bytes, dtype=torch.uint8)  # like the arena: the whole file
    for _ in range(rounds):
        _gloo_broadcasts(groups, buffer, bucket_bytes, in_flight)


def _gloo_broadcasts(groups, buffer, bucket_bytes: int, in_flight: int) -> None:  # type: ignore[no-untyped-def]
    """Broadcast i of the buffer's bucket_bytes slices over groups[i % len(groups)], with up to
    in_flight per group outstanding (the same schedule on both ranks)."""
    posted: collections.deque = collections.deque()
    for index, begin in enumerate(range(0, len(buffer), bucket_bytes)):
        group = groups[index % len(groups)]
        posted.append(group.broadcast(buffer[begin : begin + bucket_bytes], 0))
        if len(posted) >= in_flight * len(groups):
            posted.popleft().wait()
    while posted:
        posted.popleft().wait()


class GlooCeiling:
    """Gloo broadcasts of a file-sized buffer to one receiver process, nothing of rollserve in
    between: a ceiling of the dist data plane. `shape` = (process groups, bytes per broadcast,
    broadcasts in flight per group): (1, 16 MiB, 1) is gloo's plain broadcast loop; (2, 32 MiB,
    2) is what the dist plane does with flattened weights, gloo's best on the 2-core VM."""

    def __init__(self, total_bytes: int, shape: tuple[int, int, int], rounds: int) -> None:
        import datetime

        import torch
        import torch.distributed as dist
        from rollserve.client.protocol.process_group import new_process_groups

        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=120))  # fmt: skip
        ctx = mp.get_context("spawn")
        self._receiver = ctx.Process(
            target=_gloo_receiver, args=(store.port, total_bytes, shape, rounds + 1)
        )
        self._receiver.start()
        self._groups = new_process_groups(group="ceiling", master_address="127.0.0.1",
                                          master_port=store.port, world_size=2, rank=0,
                                          backend="gloo", timeout_s=120.0, store=store,
                                          lanes=shape[0])  # fmt: skip
        self._store = store
        self._buffer = torch.ones(total_bytes, dtype=torch.uint8)
        self._shape = shape
        self.gbps()  # warm-up

    def gbps(self) -> float:
        _, bucket_bytes, in_flight = self._shape
        started_s = time.perf_counter()
        _gloo_broadcasts(self._groups, self._buffer, bucket_bytes, in_flight)
        return len(self._buffer) / (time.perf_counter() - started_s) / 1e9

    def close(self) -> None:
        self._receiver.join(timeout=60)


def raw_tcp_gbps(total_bytes: int) -> float:
    """One sender and one receiver process over 127.0.0.1; GB/s (1e9) from first byte to ack."""
    ctx = mp.get_context("spawn")
    port_in, port_out = ctx.Pipe(duplex=False)
    result_in, result_out = ctx.Pipe(duplex=False)
    receiver = ctx.Process(target=_tcp_receiver, args=(port_out, total_bytes))
    receiver.start()
    port = port_in.recv()
    sender = ctx.Process(target=_tcp_sender, args=(port, total_bytes, result_out))
    sender.start()
    seconds = result_in.recv()
    sender.join()
    receiver.join()
    return total_bytes / seconds / 1e9


# ---- the model and the server -----------------------------------------------------------------


def save_actor(directory: Path, args: argparse.Namespace) -> int:
    """A random Llama actor + the byte tokenizer saved to `directory`; returns its parameters."""
    import torch
    from rollserve.server.models.default_model import build_byte_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 64), max_position_embeddings=1024,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    build_byte_tokenizer().save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def _read_status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _cpu_s(pid: int) -> float:
    """utime + stime of every thread of `pid`, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _reset_peak_rss(pid: int) -> None:
    # "5" resets VmHWM to the current RSS (Linux >= 4.0), so VmHWM then is the peak of one update.
    Path(f"/proc/{pid}/clear_refs").write_text("5")


# ---- the drain-only server (the client's ceiling) ----------------------------------------------


def _drain_server(port_out: Connection) -> None:
    """Serves UpdateWeights by parsing each message like rollserve and dropping the bytes."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from rollserve.client.protocol.wire import WireChunk, parse_update_request
    from rollserve.v1 import rollout_pb2 as pb

    def update_weights(requests, context) -> pb.UpdateWeightsResponse:
        version = received = 0
        for request in requests:
            if type(request) is WireChunk:
                received += len(request.data)
            elif isinstance(request, pb.UpdateWeightsRequest):
                version = request.header.version
        return pb.UpdateWeightsResponse(version=version, bytes=received)

    handler = grpc.stream_unary_rpc_method_handler(
        update_weights,
        request_deserializer=parse_update_request,  # as server/handlers.py registers it
        response_serializer=pb.UpdateWeightsResponse.SerializeToString,
    )
    generic = grpc.method_handlers_generic_handler(
        "rollserve.v1.Rollout", {"UpdateWeights": handler}
    )
    server = grpc.server(
        ThreadPoolExecutor(4),
        handlers=[generic],
        options=[("grpc.max_receive_message_length", 64 * MIB)],
    )
    port_out.send(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


# ---- the client process -----------------------------------------------------------------------


def _update_client(
    conn: Connection, weights_file: str, chunk_bytes: int, crc32: bool, bucket_bytes: int | None
) -> None:
    """Holds the state dict; for each (target, version, lane) received, pushes it and reports.

    Lanes: "grpc" (one stream; also against the drain server), "grpc-parallel" (--streams
    streams), "shm" (shared memory: the client copies the tensors into its memfd),
    "shm-shared" (the trainer's tensors live in the memfd: client.share_weights; no client
    copy), "dist" (a gloo broadcast through a WeightsGroup), "dist-flat" (the same, the
    trainer's tensors flattened into one buffer: WeightsGroup.flatten_weights).
    """
    from rollserve.client.client import RolloutClient
    from rollserve.client.weights.distributed import WeightsGroup
    from safetensors.torch import load_file

    state_dict = load_file(weights_file)
    clients: dict[str, RolloutClient] = {}
    groups: dict[str, WeightsGroup] = {}
    shared: dict[str, dict] = {}  # "shm-shared", "dist-flat": a state dict that was moved
    conn.send("ready")
    while (order := conn.recv()) is not None:
        target, version, lane, parallel = order  # parallel: grpc streams, or dist lanes
        client = clients.setdefault(target, RolloutClient(target, timeout_s=600.0))
        options: dict = {"chunk_bytes": chunk_bytes, "crc32": crc32}
        if lane == "shm-shared":
            if target not in shared:  # the trainer's tensors move into the client's memfd once
                shared[target] = {name: t.clone() for name, t in state_dict.items()}
                client.share_weights(shared[target])
            options = {"transport": "shm"}
        elif lane in ("dist", "dist-flat"):
            if target not in groups:
                groups[target] = WeightsGroup(
                    [client], timeout_s=120.0, lanes=parallel, bucket_bytes=bucket_bytes
                )
            if lane == "dist-flat" and target not in shared:
                shared[target] = {name: t.clone() for name, t in state_dict.items()}
                groups[target].flatten_weights(shared[target])
            options = {"transport": "dist", "group": groups[target]}
        elif lane == "grpc-parallel":
            options.update(transport="grpc", streams=parallel)
        else:
            options.update(transport=lane, streams=1 if lane == "grpc" else None)
        cpu_before = resource.getrusage(resource.RUSAGE_SELF)
        weights = shared.get(target, state_dict)
        result = client.update_weights(weights, version=version, **options)
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s = (cpu_after.ru_utime - cpu_before.ru_utime) + (
            cpu_after.ru_stime - cpu_before.ru_stime
        )
        # The drain server reports no bytes applied; the file size is what was sent.
        conn.send((result.bytes, result.wall_s, result.server_seconds, cpu_s))
    for group in groups.values():
        group.close()
    for client in clients.values():
        client.close()


@dataclass(frozen=True)
class UpdateRound:
    file_bytes: int
    wall_s: float
    server_s: float  # the server's own clock: header arrival to swap
    client_cpu_s: float
    server_cpu_s: float
    server_rss_before_gib: float
    server_peak_rss_gib: float

    @property
    def gbps(self) -> float:
        return self.file_bytes / self.wall_s / 1e9


def run_update(
    conn: Connection,
    target: str,
    server_pid: int,
    version: int,
    lane: str,
    parallel: int | None = 1,
) -> UpdateRound:
    rss_before_kib = _read_status_kib(server_pid, "VmRSS")
    _reset_peak_rss(server_pid)
    server_cpu_before = _cpu_s(server_pid)
    conn.send((target, version, lane, parallel))
    file_bytes, wall_s, server_s, client_cpu_s = conn.recv()
    server_cpu_s = _cpu_s(server_pid) - server_cpu_before
    # The server probes the new weights on its engine right after the reply (a forward pass,
    # ~55 ms on two threads for this model): let it end before the next measurement starts.
    time.sleep(PROBE_SETTLE_S)
    return UpdateRound(
        file_bytes=file_bytes,
        wall_s=wall_s,
        server_s=server_s,
        client_cpu_s=client_cpu_s,
        server_cpu_s=server_cpu_s,
        server_rss_before_gib=rss_before_kib / 2**20,
        server_peak_rss_gib=_read_status_kib(server_pid, "VmHWM") / 2**20,
    )


# ---- main ---------------------------------------------------------------------------------------


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (after a warm-up)")
    parser.add_argument("--tcp-gib", type=float, default=1.0, help="raw TCP bytes per round")
    parser.add_argument("--chunk-bytes", type=int, default=1 * MIB)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--crc32", action="store_true", help="send a CRC-32 with every chunk (default: without)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--transports",
        default=",".join(LANES),
        help=f"comma-separated lanes, each against its own server: {', '.join(LANES)}",
    )
    parser.add_argument("--streams", type=int, default=2, help="streams of grpc-parallel")
    parser.add_argument(
        "--dist-lanes", type=int, help="lanes of the dist WeightsGroup (default: its default)"
    )
    parser.add_argument(
        "--dist-bucket-bytes", type=int, help="bytes per broadcast at most (default: the default)"
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        metavar="LOAD",
        help="first wait (polling every 20 s, up to 15 minutes) until the 1-minute load average "
        "is below LOAD: other work on the 2 cores slows the CPU-bound gRPC path far more than "
        "raw TCP",
    )
    parser.add_argument(
        "--default-malloc", action="store_true", help="do not re-run with the tuned malloc env"
    )
    return parser.parse_args(argv)


def _wait_quiet(max_load: float, poll_s: float = 20.0, limit_s: float = 900.0) -> None:
    deadline_s = time.monotonic() + limit_s
    while (load := os.getloadavg()[0]) >= max_load and time.monotonic() < deadline_s:
        print(f"load average {load:.2f} >= {max_load}: waiting", flush=True)
        time.sleep(poll_s)
    quiet = "quiet" if load < max_load else "still busy after 15 minutes, going on"
    print(f"load average {load:.2f}: {quiet}", flush=True)


def _ensure_tuned_malloc(args: argparse.Namespace) -> None:
    """glibc reads MALLOC_* at start-up: re-execute this script with them set."""
    if args.default_malloc or all(os.environ.get(k) == v for k, v in TUNED_MALLOC.items()):
        return
    env = {**os.environ, **TUNED_MALLOC}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _wire_path() -> str:
    """Whether the client and the server use the wire fast path (client/wire.py), or protobuf."""
    from rollserve.client.protocol.wire import CRC32_IMPLEMENTATION
    from rollserve.client.weights import update_file as weights_module
    from rollserve.server.serving import app as app_module

    client = "wire" if hasattr(weights_module, "encode_chunk") else "protobuf"
    server = "wire" if hasattr(app_module, "add_rollout_servicer") else "protobuf"
    return f"client {client}, server {server}, CRC-32 by {CRC32_IMPLEMENTATION}"


def _machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    import grpc
    import torch
    from google.protobuf.internal import api_implementation

    return (
        f"{os.cpu_count()} x {cpu}, Linux {platform.release()}, "
        f"Python {platform.python_version()}, grpcio {grpc.__version__}, "
        f"protobuf {api_implementation.Type()}, torch {torch.__version__}"
    )


LANES = ("grpc", "grpc-parallel", "shm", "shm-shared", "dist", "dist-flat")
TARGETS = {
    "shm": 1.5,
    "shm-shared": 1.5,
    "dist": 0.6,
    "dist-flat": 0.6,
}  # x raw TCP; grpc: x the drain-only server, 0.8


def main(argv: list[str]) -> int:
    args = _parse_args(argv)
    _ensure_tuned_malloc(args)
    sys.path.insert(0, str(_TESTS_DIR))
    from helpers_server import start_server_process

    tuned = all(os.environ.get(k) == v for k, v in TUNED_MALLOC.items())
    print(f"machine: {_machine()}")
    print(f"load average before: {os.getloadavg()[0]:.2f} (2 cores shared with other work)")
    print(f"UpdateWeights path: {_wire_path()}")
    settings = " ".join(f"{k}={v}" for k, v in TUNED_MALLOC.items())
    print(f"malloc: {'tuned ' + settings if tuned else 'default'}")
    lanes = [lane for lane in args.transports.split(",") if lane]
    unknown = set(lanes) - set(LANES)
    if unknown:
        raise SystemExit(f"--transports: unknown {sorted(unknown)}; choose from {LANES}")
    tcp_bytes = int(args.tcp_gib * GIB)
    ctx = mp.get_context("spawn")
    servers = {}
    with tempfile.TemporaryDirectory(prefix="rollserve-bench-") as tmp:
        started_s = time.monotonic()
        parameters = save_actor(Path(tmp), args)
        built_s = time.monotonic() - started_s
        print(f"actor: {parameters / 1e6:.1f}M parameters, float32, built in {built_s:.1f} s")
        # One server per lane: each lane's first update is cold on both sides, and each
        # server's peak memory is that lane's own.
        for lane in lanes:
            servers[lane] = start_server_process(
                "--device", "cpu", "--dtype", "float32", "--actor", tmp, "--log-level", "WARNING",
                timeout_s=600.0,
            )  # fmt: skip
        port_in, port_out = ctx.Pipe(duplex=False)
        drain = ctx.Process(target=_drain_server, args=(port_out,), daemon=True)
        drain.start()
        targets = {lane: f"127.0.0.1:{port}" for lane, (_, port) in servers.items()}
        drain_target = f"127.0.0.1:{port_in.recv()}"
        conn, child_conn = ctx.Pipe()
        weights_file = str(Path(tmp) / "model.safetensors")
        client = ctx.Process(
            target=_update_client,
            args=(child_conn, weights_file, args.chunk_bytes, args.crc32, args.dist_bucket_bytes),
        )
        client.start()

        def update(lane: str, version: int) -> UpdateRound:
            proc, _ = servers[lane]
            parallel = args.dist_lanes if lane.startswith("dist") else args.streams
            return run_update(conn, targets[lane], proc.pid, version, lane, parallel)

        ceilings: dict[str, GlooCeiling] = {}
        try:
            assert conn.recv() == "ready"
            if args.wait_quiet is not None:  # every process is started and idle
                _wait_quiet(args.wait_quiet)
            rss_loaded_gib = {
                lane: _read_status_kib(proc.pid, "VmRSS") / 2**20
                for lane, (proc, _) in servers.items()
            }
            cold = {lane: update(lane, 1) for lane in lanes}
            raw_tcp_gbps(tcp_bytes)  # warm-ups
            run_update(conn, drain_target, drain.pid, 1, "grpc")
            import numpy as np

            copy_buffers = tuple(np.full(cold[lanes[0]].file_bytes, 1, np.uint8) for _ in range(2))
            memcpy_gbps(copy_buffers)  # warm-up
            dist_lanes = [lane for lane in lanes if lane.startswith("dist")]
            if dist_lanes:
                file_bytes = cold[dist_lanes[0]].file_bytes
                for name, shape in GLOO_CEILINGS.items():
                    ceilings[name] = GlooCeiling(file_bytes, shape, args.rounds)
            rows = []
            for index in range(args.rounds):
                row = {"tcp": raw_tcp_gbps(tcp_bytes), "memcpy": memcpy_gbps(copy_buffers)}
                for name, ceiling in ceilings.items():
                    row[name] = ceiling.gbps()
                for lane in lanes:
                    row[lane] = update(lane, index + 2)
                row["drain"] = run_update(conn, drain_target, drain.pid, index + 2, "grpc")
                rows.append(row)
                load = os.getloadavg()[0]
                print(f"round {index + 1} (load {load:.2f}): {_describe(row, lanes)}", flush=True)
        finally:
            conn.send(None)
            client.join(timeout=60)
            drain.kill()
            for ceiling in ceilings.values():
                ceiling.close()
            for proc, _ in servers.values():
                proc.terminate_and_wait()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    summary = _summary(args, parameters, lanes, rss_loaded_gib, cold, rows, tuned)
    _print_summary(summary)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _per_gib(cpu_s: float, update: UpdateRound) -> float:
    return cpu_s * GIB / update.file_bytes


def _describe(row: dict, lanes: list[str]) -> str:
    tcp = row["tcp"]
    parts = [f"raw TCP {tcp:.2f} GB/s, memcpy {row['memcpy']:.2f} GB/s"]
    for name in GLOO_CEILINGS:
        if name in row:
            parts.append(f"{name} {row[name]:.2f} GB/s")
    for lane in [*lanes, "drain"]:
        u = row[lane]
        parts.append(
            f"{lane} {u.gbps:.2f} GB/s ({u.wall_s:.3f} s) x{u.gbps / tcp:.3f}, CPU-s/GiB client "
            f"{_per_gib(u.client_cpu_s, u):.2f} server {_per_gib(u.server_cpu_s, u):.2f}"
        )
    if "grpc" in lanes:
        parts.append(f"grpc / drain {row['grpc'].gbps / row['drain'].gbps:.3f}")
    return "; ".join(parts)


def _summary(args, parameters, lanes, rss_loaded_gib, cold, rows, tuned) -> dict:
    median = statistics.median
    per_lane = {}
    for lane in [*lanes, "drain"]:
        updates = [row[lane] for row in rows]
        per_lane[lane] = {
            "ratios_to_tcp": [row[lane].gbps / row["tcp"] for row in rows],
            "median_ratio_to_memcpy": median(row[lane].gbps / row["memcpy"] for row in rows),
            "median_ratio_to_tcp": median(row[lane].gbps / row["tcp"] for row in rows),
            "median_gbps": median(u.gbps for u in updates),
            "median_warm_s": median(u.wall_s for u in updates),
            "median_client_cpu_s_per_gib": median(_per_gib(u.client_cpu_s, u) for u in updates),
            "median_server_cpu_s_per_gib": median(_per_gib(u.server_cpu_s, u) for u in updates),
            "max_warm_server_peak_rss_gib": max(u.server_peak_rss_gib for u in updates),
        }
        if lane != "drain":
            per_lane[lane].update(
                cold_s=cold[lane].wall_s,
                cold_server_peak_rss_gib=cold[lane].server_peak_rss_gib,
                server_rss_loaded_gib=rss_loaded_gib[lane],
            )
    summary = {
        "machine": _machine(),
        "malloc": "tuned" if tuned else "default",
        "parameters": parameters,
        "file_bytes": rows[0][lanes[0]].file_bytes if rows else 0,
        "chunk_bytes": args.chunk_bytes,
        "streams": args.streams,
        "dist_lanes": args.dist_lanes,
        "dist_bucket_bytes": args.dist_bucket_bytes,
        "crc32": args.crc32,
        "median_tcp_gbps": median(row["tcp"] for row in rows),
        "median_memcpy_gbps": median(row["memcpy"] for row in rows),
        "median_memcpy_over_tcp": median(row["memcpy"] / row["tcp"] for row in rows),
        "median_ceiling_over_tcp": {
            name: median(row[name] / row["tcp"] for row in rows)
            for name in GLOO_CEILINGS
            if name in rows[0]
        },
        "lanes": per_lane,
        "rounds": [
            {k: (v if isinstance(v, float) else asdict(v)) for k, v in row.items()} for row in rows
        ],
    }
    summary["median_over_ceiling"] = {
        f"{lane} / {name}": median(row[lane].gbps / row[name] for row in rows)
        for lane in lanes
        if lane.startswith("dist")
        for name in GLOO_CEILINGS
    }
    if "grpc" in lanes:
        summary["grpc_over_drain"] = [row["grpc"].gbps / row["drain"].gbps for row in rows]
        summary["median_grpc_over_drain"] = median(summary["grpc_over_drain"])
    return summary


def _print_summary(s: dict) -> None:
    print(
        f"\nfile {s['file_bytes'] / 1e9:.3f} GB ({s['parameters'] / 1e6:.1f}M params), "
        f"chunks of {s['chunk_bytes'] // 1024} KiB, {s['streams']} parallel streams, CRC-32 "
        f"{'on' if s['crc32'] else 'off'}, malloc {s['malloc']}; raw TCP median "
        f"{s['median_tcp_gbps']:.2f} GB/s; one warm memcpy of the file (2 threads) "
        f"{s['median_memcpy_gbps']:.2f} GB/s = {s['median_memcpy_over_tcp']:.2f} x raw TCP: the "
        "ceiling of any plane that copies the file once"
    )
    for lane, r in s["lanes"].items():
        target = TARGETS.get(lane)
        goal = f" (target >= {target})" if target else ""
        line = (
            f"{lane:>13}: x raw TCP {r['median_ratio_to_tcp']:.3f}{goal}, x memcpy "
            f"{r['median_ratio_to_memcpy']:.3f}, {r['median_gbps']:.2f} GB/s, warm "
            f"{r['median_warm_s']:.3f} s"
        )
        if "cold_s" in r:
            line += (
                f", cold {r['cold_s']:.3f} s; server RSS loaded {r['server_rss_loaded_gib']:.2f}"
                f" GiB, peak cold {r['cold_server_peak_rss_gib']:.2f} / warm "
                f"{r['max_warm_server_peak_rss_gib']:.2f} GiB"
            )
        line += (
            f"; CPU-s/GiB client {r['median_client_cpu_s_per_gib']:.2f} server "
            f"{r['median_server_cpu_s_per_gib']:.2f}"
        )
        print(line)
    for name, ratio in s["median_ceiling_over_tcp"].items():
        groups, bucket_bytes, in_flight = GLOO_CEILINGS[name]
        print(
            f"ceiling {name} (gloo alone: {groups} process group(s), {bucket_bytes // MIB} MiB "
            f"broadcasts, {in_flight} in flight per group): {ratio:.3f} x raw TCP"
        )
    if s["median_over_ceiling"]:
        print(", ".join(f"{pair} {r:.3f}" for pair, r in s["median_over_ceiling"].items()))
    if "median_grpc_over_drain" in s:
        print(
            f"grpc single stream / drain-only server with the same client: "
            f"{s['median_grpc_over_drain']:.3f} (target >= 0.8)"
        )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
