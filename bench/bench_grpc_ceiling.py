"""The ceiling of one sync grpcio client stream on this machine, with nothing of rollserve in it.

Per round, interleaved: raw TCP (4 MiB `sendall` -> `recv_into` a preallocated buffer, 1 GiB,
the same baseline as bench_update_weights.py) and, for each message size, a client-streaming
RPC that sends 1 GiB of raw bytes (identity serializer: one `b"".join` per message, as
rollserve's wire client does) to a server that only counts them. Prints the ratio of each to raw
TCP and the CPU cores each side used. If the ratio here is below a target, no server-side work
in rollserve can reach it (bench/RESULTS.md, UpdateWeights).

    python bench/bench_grpc_ceiling.py                      # 1 MiB messages, 5 rounds
    python bench/bench_grpc_ceiling.py --sizes-kib 512 1024 2048 4096 --rounds 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_update_weights import GIB, MIB, TUNED_MALLOC, _cpu_s, raw_tcp_gbps  # noqa: E402

_METHOD = "/ceiling.Drain/Drain"
_SOURCE_BYTES = 256 * MIB  # the client cycles over one buffer of random bytes


def _drain_server(port_out: Connection) -> None:
    import grpc

    def drain(requests, context) -> bytes:
        received = sum(len(message) for message in requests)
        return received.to_bytes(8, "little")

    handler = grpc.stream_unary_rpc_method_handler(drain)  # no (de)serializers: raw bytes
    server = grpc.server(
        ThreadPoolExecutor(4),
        handlers=[grpc.method_handlers_generic_handler("ceiling.Drain", {"Drain": handler})],
        options=[("grpc.max_receive_message_length", 64 * MIB)],
    )
    port_out.send(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


def _client(port: int, conn: Connection, total_bytes: int) -> None:
    import grpc

    channel = grpc.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 * MIB)]
    )
    call = channel.stream_unary(_METHOD)
    source = memoryview(os.urandom(_SOURCE_BYTES))

    def messages(size: int):
        for sent in range(0, total_bytes, size):
            start = sent % _SOURCE_BYTES
            yield b"".join([b"\x12\x34", source[start : start + size]])  # the one copy

    call(iter([b"warm-up"]))
    while (size := conn.recv()) is not None:
        before = resource.getrusage(resource.RUSAGE_SELF)
        started_s = time.perf_counter()
        call(messages(size))
        wall_s = time.perf_counter() - started_s
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu_s = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        conn.send((wall_s, cpu_s))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[1024])
    parser.add_argument("--gib", type=float, default=1.0, help="bytes per measurement")
    args = parser.parse_args(argv)
    if not all(os.environ.get(k) == v for k, v in TUNED_MALLOC.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **TUNED_MALLOC})
    total_bytes = int(args.gib * GIB)
    ctx = mp.get_context("spawn")
    port_in, port_out = ctx.Pipe(duplex=False)
    server = ctx.Process(target=_drain_server, args=(port_out,), daemon=True)
    server.start()
    conn, child_conn = ctx.Pipe()
    client = ctx.Process(target=_client, args=(port_in.recv(), child_conn, total_bytes))
    client.start()
    raw_tcp_gbps(total_bytes)  # warm-up
    ratios: dict[int, list[float]] = {size: [] for size in args.sizes_kib}
    try:
        for index in range(args.rounds):
            tcp = raw_tcp_gbps(total_bytes)
            line = [f"round {index + 1} (load {os.getloadavg()[0]:.2f}): raw TCP {tcp:.2f} GB/s"]
            for size_kib in args.sizes_kib:
                server_cpu_before = _cpu_s(server.pid)
                conn.send(size_kib * 1024)
                wall_s, client_cpu_s = conn.recv()
                server_cpu_s = _cpu_s(server.pid) - server_cpu_before
                gbps = total_bytes / wall_s / 1e9
                ratios[size_kib].append(gbps / tcp)
                line.append(
                    f"{size_kib} KiB {gbps:.2f} GB/s = {gbps / tcp:.3f} (cores: client "
                    f"{client_cpu_s / wall_s:.2f}, server {server_cpu_s / wall_s:.2f})"
                )
            print("; ".join(line), flush=True)
    finally:
        conn.send(None)
        client.join(timeout=60)
        server.kill()
    for size_kib, values in ratios.items():
        print(f"median ratio, {size_kib} KiB messages / raw TCP: {statistics.median(values):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
