"""The fixed cost of a weight update: milliseconds per update of a model of many tiny tensors.

A `rollserve serve` subprocess holds a Qwen2-shaped model of --layers layers (24: 291 tensors,
as Qwen2-0.5B) of tiny width, so its bytes cost nothing and what an update takes is the work
per update and per tensor: the client's file head and export, the RPC, the server's head check,
value checks, swap and reply. The baseline, measured in the same run: a Health call's round
trip (the floor of any RPC on this machine). Each lane runs two ways:

* same head: every update sends the same tensors in the same order, as a trainer does at each
  step (the server reuses the head it verified last: stream.py, VerifiedHead);
* new head: the updates alternate between two orders of the tensors, so each head differs from
  the one before and is parsed and planned again (the cost before heads were remembered).

    python bench/bench_update_latency.py                  # a CPU server: grpc, shm, dist (~1 min)
    python bench/bench_update_latency.py --device cuda    # + cuda_ipc, per tensor and flat

A second table sets the calls that carry only the header and the file's head (dist; cuda_ipc
on CUDA) as one unary UpdateWeightsAtOnce against the same messages on a stream, interleaved
update by update.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "tests"))
from helpers_server import start_server_process  # noqa: E402
from rollserve.client import RolloutClient  # noqa: E402
from rollserve.client.weights.distributed import WeightsGroup  # noqa: E402
from rollserve.client.weights.flat_weights import flatten_weights  # noqa: E402

WAIT_S = 120.0


def save_model(directory: Path, layers: int) -> dict[str, torch.Tensor]:
    """A random tiny-width Qwen2 (q/k/v biases, untied lm_head) and the byte tokenizer."""
    from rollserve.server.models.default_model import build_byte_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    build_byte_tokenizer().save_pretrained(directory)
    return {name: t.detach().contiguous() for name, t in model.state_dict().items()}


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


class Lane:
    """Updates of one transport: (client wall seconds, server seconds) per update."""

    def __init__(
        self,
        client: RolloutClient,
        transport: str,
        version: int,
        pack: bool = False,
        group: WeightsGroup | None = None,
    ) -> None:
        self.client = client
        self.transport = transport
        self.version = version
        self.pack = pack  # cuda_ipc: copied into one buffer of the client first
        self.group = group  # dist: the group whose broadcast carries the data

    def run(
        self, states: list[dict[str, torch.Tensor]], updates: int, warm_up: bool = True
    ) -> tuple[float, float]:
        """Median client and server ms over `updates` updates cycling through `states`, after
        one warm-up update of each state (unless not `warm_up`)."""
        walls, servers = [], []
        skipped = len(states) if warm_up else 0
        for index in range(skipped + updates):
            self.version += 1
            state = states[index % len(states)]
            started = time.perf_counter()
            if self.group is not None:
                result = self.client.update_weights(state, version=self.version, group=self.group)
            else:
                result = self.client.update_weights(
                    state,
                    version=self.version,
                    transport=self.transport,
                    # One stream for grpc: with the default (a stream per 4 cores) a 16-core
                    # GPU node sends this model as 4 parallel parts ("grpc-parallel").
                    streams=1 if self.transport == "grpc" else None,
                    pack=self.pack,
                )
            wall = time.perf_counter() - started
            if result.transport != self.transport:
                raise RuntimeError(f"asked for {self.transport}, got {result.transport}")
            if index >= skipped:
                walls.append(wall)
                servers.append(result.server_seconds)
        return median_ms(walls), median_ms(servers)


def at_once_against_stream(lane: Lane, state: dict[str, torch.Tensor], updates: int) -> str:
    """The lane's updates alternating between one UpdateWeightsAtOnce call and a stream of the
    same messages (ServerCalls.use_at_once), `updates` of each after one warm-up of each: a
    table row of median client ms (server ms) for both and their ratio."""
    calls = lane.client.weights_calls
    walls: dict[bool, list[float]] = {True: [], False: []}
    servers: dict[bool, list[float]] = {True: [], False: []}
    try:
        for index in range(2 * (updates + 1)):
            at_once = index % 2 == 0
            calls.use_at_once = at_once
            wall, server = lane.run([state], 1, warm_up=False)
            if index >= 2:
                walls[at_once].append(wall)
                servers[at_once].append(server)
    finally:
        calls.use_at_once = True
    one, stream = statistics.median(walls[True]), statistics.median(walls[False])
    return (
        f"{one:.2f} ({statistics.median(servers[True]):.2f}) | "
        f"{stream:.2f} ({statistics.median(servers[False]):.2f}) | {one / stream:.2f}"
    )


def last_phases(log: str) -> str:
    """The phases of the server's last update (its log line, weights/update.py)."""
    return [line for line in log.splitlines() if "phases: " in line][-1].split("phases: ")[-1]


def reordered(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors in reverse order: another head (offsets and order differ)."""
    return dict(reversed(list(state.items())))


def on_cuda(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.cuda() for name, t in state.items()}


def flat(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    copy = {name: t.clone() for name, t in state.items()}
    flatten_weights(copy)
    return copy


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--updates", type=int, default=20, help="measured updates per lane")
    parser.add_argument("--phases", action="store_true", help="print each lane's last phases")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (run without --device cuda)")
        return 0
    label = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"device: {label}; torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rollserve-update-latency-") as tmp:
        state = save_model(Path(tmp), args.layers)
        print(f"model: {len(state)} tensors, {sum(t.nbytes for t in state.values())} bytes")
        proc, port = start_server_process(
            "--device", args.device, "--actor", tmp, "--generation-path", "hf",
            "--metrics-port", "0", "--log-level", "INFO", timeout_s=WAIT_S,
        )  # fmt: skip
        try:
            with RolloutClient(f"127.0.0.1:{port}", timeout_s=WAIT_S) as client:
                health = []
                for _ in range(args.updates + 5):
                    started = time.perf_counter()
                    client.health()
                    health.append(time.perf_counter() - started)
                rtt = median_ms(health[5:])
                print(f"baseline: Health round trip {rtt:.2f} ms (median of {args.updates})")
                lanes: list[tuple[str, str, Callable[[dict], dict]]] = [
                    ("grpc", "CPU tensors", lambda s: s),
                    ("shm", "CPU tensors", lambda s: s),
                ]
                if args.device == "cuda":
                    lanes += [
                        ("cuda_ipc", "CUDA, per tensor", on_cuda),
                        ("cuda_ipc", "CUDA, flat", lambda s: flat(on_cuda(s))),
                        ("cuda_ipc", "CUDA, pack=True", on_cuda),
                    ]
                version = client.health().policy_version
                print("| lane | tensors | same head ms (server) | new head ms (server) | "
                      "same head / Health RTT |\n| --- | --- | --- | --- | --- |")  # fmt: skip
                for transport, where, make in lanes:
                    lane = Lane(client, transport, version, pack=where.endswith("pack=True"))
                    same = lane.run([make(state)], args.updates)
                    same_phases = last_phases(proc.log_text())
                    new = lane.run([make(state), make(reordered(state))], args.updates)
                    version = lane.version
                    print(f"| {transport} | {where} | {same[0]:.2f} ({same[1]:.2f}) | "
                          f"{new[0]:.2f} ({new[1]:.2f}) | {same[0] / rtt:.1f} |",
                          flush=True)  # fmt: skip
                    if args.phases:
                        print(f"  same head, last update: {same_phases}")
                        print(f"  new head, last update: {last_phases(proc.log_text())}")
                # The calls that carry only the header and the head (dist, cuda_ipc): one
                # unary UpdateWeightsAtOnce against a stream of the same messages, interleaved.
                print("\n| lane | tensors | at once ms (server) | stream ms (server) | "
                      "at once / stream |\n| --- | --- | --- | --- | --- |")  # fmt: skip
                with WeightsGroup([client], timeout_s=WAIT_S) as group:
                    lane = Lane(client, "dist", version, group=group)
                    row = at_once_against_stream(lane, state, args.updates)
                    version = lane.version
                print(f"| dist | CPU tensors (gloo) | {row} |", flush=True)
                if args.device == "cuda":
                    lane = Lane(client, "cuda_ipc", version)
                    row = at_once_against_stream(lane, flat(on_cuda(state)), args.updates)
                    version = lane.version
                    print(f"| cuda_ipc | CUDA, flat | {row} |", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
