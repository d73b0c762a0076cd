"""The long hardening campaign (issue 12): fuzz, cut and stalled uploads, sustained load.

    .venv/bin/python bench/soak.py                      # 10,000 fuzz cases, 25 cuts, 60 s load
    .venv/bin/python bench/soak.py --fuzz-cases 500 --cut-rounds 5 --load-s 15   # a quick pass

Each phase runs against its own `rollserve serve` subprocess on 127.0.0.1 (tiny Llama actors
built from configs, CPU), and prints a markdown report (bench/RESULTS.md keeps one):

1. fuzz: tests/helpers_fuzz.py cases (random and bit-flipped bytes to every RPC, field mutations
   of MakeExperience and Subscribe, lying or broken UpdateWeights streams), fixed seed. Counts
   per category and status; INTERNAL/UNKNOWN, hangs (a call reaching its deadline) and crashes
   must be 0; afterwards the greedy log-probs equal those before, and the version moved only by
   the streams the server accepted (they carry the served weights, so weights stay bit-equal).
2. cuts: a ~60 MB actor, --update-idle-timeout-s 1; rounds of uploads cancelled after the header,
   mid-tensor and before the last chunk, stalled until the idle deadline, and uploader processes
   SIGKILLed half way. After each: log-probs and version unchanged, next update succeeds; RSS
   against the baseline taken after a warm-up update.
3. load: --clients concurrent clients for --load-s seconds: MakeExperience, Health and Subscribe
   (the server runs a continuous rollout) and one client pushing UpdateWeights every few seconds.
   Status counts and p50/p99 latency per RPC, server RSS at start and end, and every row's
   policy_version checked against the updates acknowledged before its call started and started
   before it ended.
4. held (issue 22): slow readers and held handler threads at once, --max-workers 16: MakeExperience
   streams never read, a Subscribe reader that never reads (a client without a window), a
   subscriber that never acknowledges, parallel parts waiting for a part 0 that never comes, and
   InitWeightsGroup toward a closed port (timeout_s 3600). Health and grpc.health.v1 latency,
   server threads and RSS before, during and after; during: a normal MakeExperience, UpdateWeights
   and Subscribe succeed; after: the attackers leave (every held call is cancelled, which frees
   its handler at once) and the figures go back. Then the same attack again and SIGTERM: the exit
   code (3: calls cancelled; 4: the engine's batch outlasted the bound) and how long the stop
   took against --shutdown-grace-s.

Exit code 0 when every check held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import grpc  # noqa: E402
import torch  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from helpers_fuzz import FuzzReport, WeightsStreams, fuzz_cases, run_case  # noqa: E402
from helpers_server import (  # noqa: E402
    ServerProcess,
    free_port,
    greedy_snapshot,
    rss_bytes,
    start_server_process,
)
from rollserve.client.client import RolloutClient  # noqa: E402
from rollserve.client.protocol.wire import update_weights_callable  # noqa: E402
from rollserve.client.weights.update_file import update_weights_messages  # noqa: E402
from rollserve.server.config import ServerConfig  # noqa: E402
from rollserve.server.models import load_models  # noqa: E402
from rollserve.server.models.default_model import TinyModelSpec, save_tiny_causal_lm  # noqa: E402
from rollserve.server.serving.exit_codes import STOP_BOUND_S  # noqa: E402
from rollserve.server.serving.thread_pool import IDLE_THREAD_S  # noqa: E402
from rollserve.v1 import rollout_pb2 as pb  # noqa: E402
from rollserve.v1 import rollout_pb2_grpc  # noqa: E402

CALL_TIMEOUT_S = 60.0  # a call that reaches it counts as a hang
MIB = 1 << 20


def state_dict_of(actor_dir: Path) -> dict[str, torch.Tensor]:
    module = load_models(ServerConfig(device="cpu", actor=str(actor_dir))).actor.module
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def start(*args: str) -> tuple[ServerProcess, str]:
    proc, port = start_server_process("--device", "cpu", "--metrics-port", "0", *args)
    return proc, f"127.0.0.1:{port}"


def server_health(proc: ServerProcess) -> str:
    log = proc.log_text()
    return f"tracebacks in log: {log.count('Traceback')}, exit code {proc.terminate_and_wait()}"


# ---- 1. fuzz ------------------------------------------------------------------------------------


def phase_fuzz(workdir: Path, cases: int, seed: int) -> tuple[dict, bool]:
    actor_dir = save_tiny_causal_lm(workdir / "fuzz-actor")
    weights = state_dict_of(actor_dir)
    proc, target = start("--actor", str(actor_dir))
    before, start_version = greedy_snapshot(target, CALL_TIMEOUT_S)
    version = {"now": start_version}
    report = FuzzReport()
    crashed = None
    started_s = time.monotonic()
    options = [("grpc.max_send_message_length", 64 * MIB)]
    with grpc.insecure_channel(target, options=options) as channel:
        for case in fuzz_cases(
            seed,
            cases,
            vocab_size=259,
            streams=WeightsStreams(weights),
            next_version=lambda: version["now"] + 1,
        ):
            outcome = run_case(channel, case, CALL_TIMEOUT_S)
            report.add(outcome)
            if case.method == "UpdateWeights" and outcome.code is grpc.StatusCode.OK:
                version["now"] += 1
            if proc.poll() is not None:
                crashed = f"{case.category} {case.note}"
                break
    seconds = time.monotonic() - started_s
    after, end_version = greedy_snapshot(target, CALL_TIMEOUT_S) if crashed is None else ([], -1)
    result = {
        "cases": report.total,
        "seconds": round(seconds, 1),
        "by_category": report.counts,
        "internal_or_unknown": report.code_total("INTERNAL") + report.code_total("UNKNOWN"),
        "hangs": report.code_total("DEADLINE_EXCEEDED"),
        "crash": crashed,
        "unacceptable": [
            f"{o.case.category} {o.case.method} [{o.case.note[:80]}]: {o.code.name} "
            f"{o.details[:120]}"
            for o in report.bad[:20]
        ],
        "slowest_call_s": round(report.slowest_s, 2),
        "accepted_updates": report.accepted_updates,
        "log_probs_unchanged": after == before,
        "version": [start_version, end_version],
        "server": server_health(proc),
    }
    ok = (
        not report.bad
        and crashed is None
        and after == before
        and end_version == start_version + report.accepted_updates
    )
    return result, ok


# ---- 2. cut and stalled uploads -----------------------------------------------------------------

_UPLOADER = """
import sys, time, pathlib
import grpc
from safetensors.torch import load_file
from rollserve.client.weights.update_file import update_weights_messages
from rollserve.client.protocol.wire import update_weights_callable
target, weights_file, version, ready = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
encoded = list(update_weights_messages(load_file(weights_file), target="actor", version=version,
                                       mode="full", chunk_bytes=1 << 20))
def stream():
    yield from encoded[: len(encoded) // 2]
    pathlib.Path(ready).write_text("sent")
    time.sleep(600)
with grpc.insecure_channel(target) as channel:
    update_weights_callable(channel)(stream())
"""


def _perturbed(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: t + 0.01 * torch.randn(t.shape, generator=generator) for n, t in weights.items()}


def _cut_upload(target: str, encoded: list[bytes], stop_at: int, cancel: bool) -> str:
    """Send encoded[:stop_at], then cancel (or idle until the server ends the call)."""
    reached, release = threading.Event(), threading.Event()

    def stream():
        yield from encoded[:stop_at]
        reached.set()
        release.wait(CALL_TIMEOUT_S)

    with grpc.insecure_channel(target) as channel:
        future = update_weights_callable(channel).future(stream())
        try:
            reached.wait(CALL_TIMEOUT_S)
            if cancel:
                time.sleep(0.2)
                future.cancel()
                return "CANCELLED (by the client)" if future.cancelled() else "finished first"
            error = future.exception(timeout=CALL_TIMEOUT_S)
        finally:
            release.set()
    return "OK" if error is None else error.code().name


def _killed_upload(target: str, weights, version: int, workdir: Path, seed: int) -> str:
    from safetensors.torch import save_file

    weights_file = workdir / f"kill-{seed}.safetensors"
    save_file({n: t.contiguous() for n, t in _perturbed(weights, seed).items()}, weights_file)
    ready = workdir / f"ready-{seed}"
    uploader = subprocess.Popen(
        [sys.executable, "-c", _UPLOADER, target, str(weights_file), str(version), str(ready)]
    )
    deadline_s = time.monotonic() + CALL_TIMEOUT_S
    while not ready.exists() and uploader.poll() is None and time.monotonic() < deadline_s:
        time.sleep(0.05)
    time.sleep(0.2)
    uploader.kill()
    uploader.wait()
    weights_file.unlink()
    return f"SIGKILL (exit {uploader.returncode})"


def phase_cuts(workdir: Path, rounds: int) -> tuple[dict, bool]:
    spec = TinyModelSpec(hidden_size=512, intermediate_size=4096)
    actor_dir = save_tiny_causal_lm(workdir / "cut-actor", spec)
    weights = state_dict_of(actor_dir)
    proc, target = start("--actor", str(actor_dir), "--update-idle-timeout-s", "1")
    with RolloutClient(target, timeout_s=CALL_TIMEOUT_S) as client:
        # Warm-up: measured, RSS reaches its steady state on the second update (the first one's
        # arena replaces pages of the loaded checkpoint), and after a few experience calls.
        client.update_weights(weights, version=1, chunk_bytes=MIB, transport="grpc")
        client.update_weights(weights, version=2, chunk_bytes=MIB, transport="grpc")
    for _ in range(3):
        greedy_snapshot(target, CALL_TIMEOUT_S)
    baseline_rss = rss_bytes(proc.pid)
    kinds = ["after_header", "mid_tensor", "before_last_chunk", "stalled", "sigkilled"]
    outcomes: dict[str, Counter] = defaultdict(Counter)
    max_rss_over = 0
    rss_per_round_mib = []
    failures = []
    for index in range(rounds):
        kind = kinds[index % len(kinds)]
        before = greedy_snapshot(target, CALL_TIMEOUT_S)
        encoded = list(
            update_weights_messages(
                _perturbed(weights, index),
                target="actor",
                version=before[1] + 1,
                mode="full",
                chunk_bytes=MIB,
            )
        )
        stop_at = {"after_header": 1, "mid_tensor": 2, "before_last_chunk": len(encoded) - 1}
        if kind == "sigkilled":
            code = _killed_upload(target, weights, before[1] + 1, workdir, index)
        else:
            stop = stop_at.get(kind, len(encoded) // 2)
            code = _cut_upload(target, encoded, stop, cancel=kind != "stalled")
        outcomes[kind][code] += 1
        after = greedy_snapshot(target, CALL_TIMEOUT_S)
        time.sleep(0.3)
        max_rss_over = max(max_rss_over, rss_bytes(proc.pid) - baseline_rss)
        rss_per_round_mib.append(round(rss_bytes(proc.pid) / MIB))
        with RolloutClient(target, timeout_s=CALL_TIMEOUT_S) as client:
            next_ok = client.update_weights(
                weights, version=before[1] + 1, chunk_bytes=MIB, transport="grpc"
            )
        if after != before or next_ok.version != before[1] + 1:
            failures.append(f"round {index} ({kind}): weights/version changed or next update bad")
    end_rss = rss_bytes(proc.pid)
    result = {
        "rounds": rounds,
        "model_bytes": sum(t.numel() * t.element_size() for t in weights.values()),
        "outcomes": {kind: dict(codes) for kind, codes in outcomes.items()},
        "rss_baseline_mib": round(baseline_rss / MIB, 1),
        "rss_end_mib": round(end_rss / MIB, 1),
        "rss_max_over_baseline_mib": round(max_rss_over / MIB, 1),
        "rss_per_round_mib": rss_per_round_mib,
        "failures": failures,
        "server": server_health(proc),
    }
    # Flat: no staging copy kept (end within one model size of the baseline; measured, gRPC's
    # threads' malloc arenas settle ~30 MiB above it over the first rounds), no growth after.
    half = rss_per_round_mib[len(rss_per_round_mib) // 2] if rss_per_round_mib else 0
    flat = end_rss - baseline_rss < result["model_bytes"] and end_rss / MIB - half < 16
    return result, not failures and flat


# ---- 3. sustained load --------------------------------------------------------------------------


@dataclass
class Load:
    """Shared by the load threads: latencies, statuses, update times, violations."""

    latencies_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    codes: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    acked: list[tuple[float, int]] = field(default_factory=list)  # (time acknowledged, version)
    started: list[tuple[float, int]] = field(default_factory=list)  # (time started, version)
    violations: list[str] = field(default_factory=list)
    rows_checked: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, rpc: str, seconds: float, code: str) -> None:
        with self.lock:
            self.latencies_s[rpc].append(seconds)
            self.codes[rpc][code] += 1

    def acked_before(self, t: float, initial: int) -> int:
        with self.lock:
            return max([v for at, v in self.acked if at <= t], default=initial)

    def started_before(self, t: float, initial: int) -> int:
        with self.lock:
            return max([v for at, v in self.started if at <= t], default=initial)

    def check_rows(self, what: str, versions: list[int], low: int, high: int) -> None:
        with self.lock:
            self.rows_checked += len(versions)
            bad = [v for v in versions if not low <= v <= high]
            if bad:
                self.violations.append(
                    f"{what}: versions {sorted(set(bad))} not in [{low}, {high}]"
                )


def _timed(load: Load, rpc: str, call: Callable[[], object]) -> object:
    started_s = time.monotonic()
    try:
        result = call()
        code = "OK"
    except grpc.RpcError as error:
        result, code = None, error.code().name
    except Exception as error:  # the client's typed errors carry the code in their name
        result, code = None, getattr(getattr(error, "code", None), "name", type(error).__name__)
    load.record(rpc, time.monotonic() - started_s, code)
    return result


def _experience_client(target: str, load: Load, stop: threading.Event, initial: int, seed: int):
    with RolloutClient(target, timeout_s=CALL_TIMEOUT_S) as client:
        while not stop.is_set():
            t0 = time.monotonic()
            experience = _timed(
                load,
                "MakeExperience",
                lambda seed=seed: client.make_experience(
                    [[1, 72 + seed % 50, 101], [1, 50, 51, 52]],
                    samples_per_prompt=2,
                    max_new_tokens=8,
                    seed=seed,
                    rewards=["exact_match"],
                    gt_answers=["a", "b"],
                ),
            )
            t1 = time.monotonic()
            if experience is not None:
                load.check_rows(
                    "MakeExperience",
                    experience.policy_version.tolist(),
                    load.acked_before(t0, initial),
                    load.started_before(t1, initial),
                )
            seed += 1


def _health_client(target: str, load: Load, stop: threading.Event):
    with RolloutClient(target, timeout_s=CALL_TIMEOUT_S) as client:
        while not stop.is_set():
            _timed(load, "Health", client.health)
            time.sleep(0.02)


def _subscribe_client(target: str, load: Load, stop: threading.Event, initial: int, name: str):
    with RolloutClient(target, timeout_s=CALL_TIMEOUT_S) as client:
        while not stop.is_set():
            t0 = time.monotonic()
            low = load.acked_before(t0, initial) - 1  # --max-staleness 1
            waited_s = time.monotonic()
            try:
                for batch in client.subscribe(name, max_batches=3, timeout_s=CALL_TIMEOUT_S):
                    load.record("Subscribe (per batch)", time.monotonic() - waited_s, "OK")
                    versions = batch.experience.policy_version.tolist()
                    load.check_rows("Subscribe", versions, low, load.started_before(
                        time.monotonic(), initial))  # fmt: skip
                    waited_s = time.monotonic()
                    if stop.is_set():
                        break
            except Exception as error:
                code = getattr(getattr(error, "code", None), "name", type(error).__name__)
                load.record("Subscribe (per batch)", time.monotonic() - waited_s, code)


def _updater(target: str, load: Load, stop: threading.Event, weights, every_s: float) -> None:
    with RolloutClient(target, timeout_s=CALL_TIMEOUT_S) as client:
        version = client.health().policy_version
        while not stop.wait(every_s):
            version += 1
            with load.lock:
                load.started.append((time.monotonic(), version))
            result = _timed(
                load, "UpdateWeights", lambda v=version: client.update_weights(weights, version=v)
            )
            if result is not None:
                with load.lock:
                    load.acked.append((time.monotonic(), version))


def _percentile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def phase_load(
    workdir: Path, seconds: float, clients: int, update_every_s: float
) -> tuple[dict, bool]:
    actor_dir = save_tiny_causal_lm(workdir / "load-actor")
    weights = state_dict_of(actor_dir)
    prompts = workdir / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"q{i}=", "gt_answer": str(i)}) + "\n" for i in range(64))
    )
    template = workdir / "template.json"
    template.write_text(json.dumps({
        "samplesPerPrompt": 2, "sampling": {"maxNewTokens": 6},
        "algorithm": {"advantageEstimator": "group_norm"}, "rewards": [{"source": "exact_match"}],
    }))  # fmt: skip
    proc, target = start(
        "--actor", str(actor_dir), "--rollout-prompts", str(prompts),
        "--rollout-request", str(template), "--rollout-epochs", "0",
        "--rollout-prompts-per-batch", "2",
    )  # fmt: skip
    before, initial = greedy_snapshot(target, CALL_TIMEOUT_S)
    load = Load()
    stop = threading.Event()
    roles = ["experience"] * (clients - 1 - 3 - 3) + ["health"] * 3 + ["subscribe"] * 3
    threads = [
        threading.Thread(target=_updater, args=(target, load, stop, weights, update_every_s))
    ]
    for index, role in enumerate(roles):
        if role == "experience":
            args = (target, load, stop, initial, 1000 * index)
            threads.append(threading.Thread(target=_experience_client, args=args))
        elif role == "health":
            threads.append(threading.Thread(target=_health_client, args=(target, load, stop)))
        else:
            args = (target, load, stop, initial, f"soak-{index}")
            threads.append(threading.Thread(target=_subscribe_client, args=args))
    rss_samples: list[tuple[float, int]] = []
    started_s = time.monotonic()
    for thread in threads:
        thread.start()
    while time.monotonic() - started_s < seconds:
        rss_samples.append((time.monotonic() - started_s, rss_bytes(proc.pid)))
        time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join(CALL_TIMEOUT_S + 10)
    hung_threads = sum(thread.is_alive() for thread in threads)
    after, final_version = greedy_snapshot(target, CALL_TIMEOUT_S)
    table = {}
    for rpc, values in sorted(load.latencies_s.items()):
        table[rpc] = {
            "calls": len(values),
            "p50_ms": round(_percentile(values, 50) * 1e3, 1),
            "p99_ms": round(_percentile(values, 99) * 1e3, 1),
            "statuses": dict(load.codes[rpc]),
        }
    first_rss = rss_samples[min(5, len(rss_samples) - 1)][1]  # after the first seconds' warm-up
    result = {
        "seconds": seconds,
        "clients": clients,
        "roles": dict(Counter(roles), updater=1),
        "latency": table,
        "updates_acknowledged": len(load.acked),
        "versions": [initial, final_version],
        "rows_checked": load.rows_checked,
        "version_violations": load.violations[:20],
        "rss_mib_at_5s": round(first_rss / MIB, 1),
        "rss_mib_end": round(rss_samples[-1][1] / MIB, 1),
        "rss_mib_max": round(max(r for _, r in rss_samples) / MIB, 1),
        "log_probs_unchanged": after == before,  # the updates pushed the same weights
        "hung_client_threads": hung_threads,
        "server": server_health(proc),
    }
    errors = sum(
        count
        for rpc in load.codes.values()
        for code, count in rpc.items()
        if code in ("INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED")
    )
    ok = not load.violations and not hung_threads and errors == 0 and after == before
    return result, ok


# ---- 4. slow readers and held handler threads ----------------------------------------------------

# A channel that takes little before its reader reads: no BDP probing, a small lookahead.
_SMALL_WINDOWS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
_HELD_TIMER_S = 10.0  # the server's send timeout, part wait and group cap in this phase
_HELD_GRACE_S = 2.0


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return -1


def _probe_for(target: str, seconds: float) -> dict:
    """Rollout.Health and grpc.health.v1 Check, one after the other, for `seconds`."""
    latencies: list[float] = []
    failures = Counter()
    with grpc.insecure_channel(target) as channel:
        health = rollout_pb2_grpc.RolloutStub(channel).Health
        check = health_pb2_grpc.HealthStub(channel).Check
        stop_s = time.monotonic() + seconds
        while time.monotonic() < stop_s:
            for call, request in (
                (health, pb.HealthRequest()),
                (check, health_pb2.HealthCheckRequest()),
            ):
                started_s = time.monotonic()
                try:
                    call(request, timeout=3.0)
                    latencies.append(time.monotonic() - started_s)
                except grpc.RpcError as error:
                    failures[error.code().name] += 1
            time.sleep(0.01)
    return {
        "probes": len(latencies),
        "p50_ms": round(_percentile(latencies, 50) * 1e3, 1),
        "max_ms": round(max(latencies, default=float("nan")) * 1e3, 1),
        "failed": dict(failures),
    }


def _snapshot(proc: ServerProcess, target: str, seconds: float) -> dict:
    figures = _probe_for(target, seconds)
    figures.update(threads=_threads(proc.pid), rss_mib=round(rss_bytes(proc.pid) / MIB, 1))
    return figures


class _Attack:
    """Every slow reader and held thread of issue 22 against one server, until `release()`."""

    def __init__(self, target: str, closed_port: int) -> None:
        self.release_event = threading.Event()
        self.channels = [grpc.insecure_channel(target, options=_SMALL_WINDOWS) for _ in range(4)]
        stubs = [rollout_pb2_grpc.RolloutStub(channel) for channel in self.channels]
        rows = 128
        bulky = pb.MakeExperienceRequest(
            token_ids=pb.RaggedTokenIds(values=[5, 6, 7] * rows, lengths=[3] * rows),
            sampling=pb.SamplingOptions(max_new_tokens=32, seed=5, ignore_eos=True),
            rewards=[pb.RewardTerm(source="exact_match")],
            gt_answers=["x"] * rows,
            batching=pb.BatchingOptions(micro_batch_size=rows, generate_batch_size=rows),
        )
        # Never read: 3 MakeExperience streams, a Subscribe without a window, one with a
        # window that never acknowledges (its handler waits in the dealer, not in a send).
        self.calls: list = [stubs[i].MakeExperience(bulky, timeout=300.0) for i in range(3)]
        self.calls.append(stubs[3].Subscribe(iter([pb.SubscribeRequest(subscriber_id="stuck")]),
                                             timeout=300.0))  # fmt: skip
        self.calls.append(stubs[3].Subscribe(self._held([pb.SubscribeRequest(
            subscriber_id="no-acks", window=1)]), timeout=300.0))  # fmt: skip
        # Held peer waits: 9 parallel parts of unknown updates (8 wait, 1 is refused), 3
        # InitWeightsGroup joins toward a closed port (2 join, 1 is refused).
        self.futures = []
        for i in range(9):
            header = pb.WeightsHeader(target=pb.MODEL_ROLE_ACTOR, version=1, total_bytes=1000)
            header.parallel.update_id = f"ghost-{i}"
            header.parallel.streams, header.parallel.index = 2, 1
            header.parallel.begin, header.parallel.end = 500, 1000
            stream = self._held([pb.UpdateWeightsRequest(header=header)])
            self.futures.append(stubs[3].UpdateWeights.future(stream, timeout=300.0))
        for i in range(3):
            join = pb.InitWeightsGroupRequest(
                group=f"closed-{i}", master_address="127.0.0.1", master_port=closed_port,
                world_size=2, rank=1, timeout_s=3600.0,
            )  # fmt: skip
            self.futures.append(stubs[3].InitWeightsGroup.future(join, timeout=300.0))

    def _held(self, requests: list) -> object:
        def stream():
            yield from requests
            self.release_event.wait(300.0)

        return stream()

    def ended(self) -> list[str]:
        """The codes of the held calls that have ended (those refused at once, early on)."""
        return [f.exception(timeout=0).code().name for f in self.futures if f.done()]

    def release(self) -> None:
        """Cancel every call and close the channels."""
        self.release_event.set()
        for call in self.calls + self.futures:
            call.cancel()
        for channel in self.channels:
            channel.close()


def _normal_calls(target: str, weights: dict[str, torch.Tensor], version: int) -> dict:
    """A normal MakeExperience, UpdateWeights and Subscribe (one batch), each timed."""
    out = {}
    with RolloutClient(target, timeout_s=30.0) as client:
        for name, call in (
            ("MakeExperience", lambda: client.make_experience(
                [[1, 72, 101]], max_new_tokens=4, rewards=["exact_match"], gt_answers=["a"])),
            ("UpdateWeights", lambda: client.update_weights(weights, version=version)),
            ("Subscribe", lambda: next(iter(client.subscribe("normal", max_batches=1)))),
        ):  # fmt: skip
            started_s = time.monotonic()
            try:
                call()
                code = "OK"
            except Exception as error:  # the client's typed errors carry the code
                code = getattr(getattr(error, "code", None), "name", type(error).__name__)
            out[name] = f"{code} in {time.monotonic() - started_s:.2f} s"
    return out


def phase_held(workdir: Path, during_s: float) -> tuple[dict, bool]:
    actor_dir = save_tiny_causal_lm(workdir / "held-actor")
    weights = state_dict_of(actor_dir)
    prompts = workdir / "held-prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"q{i}=", "gt_answer": str(i)}) + "\n" for i in range(64))
    )
    template = workdir / "held-template.json"  # 64-row batches over 100 KB: a send blocks
    template.write_text(json.dumps({
        "samplesPerPrompt": 2, "sampling": {"maxNewTokens": 32, "ignoreEos": True},
        "algorithm": {"advantageEstimator": "group_norm"}, "rewards": [{"source": "exact_match"}],
    }))  # fmt: skip
    timer = str(_HELD_TIMER_S)
    flags = (
        "--actor", str(actor_dir), "--max-workers", "16", "--stream-send-timeout-s", timer,
        "--parallel-part-wait-s", timer, "--max-group-timeout-s", timer,
        "--shutdown-grace-s", str(_HELD_GRACE_S), "--rollout-prompts", str(prompts),
        "--rollout-request", str(template), "--rollout-epochs", "0",
        "--rollout-prompts-per-batch", "32",
    )  # fmt: skip
    proc, target = start(*flags)
    result: dict = {"timers_s": _HELD_TIMER_S, "grace_s": _HELD_GRACE_S}
    result["before"] = _snapshot(proc, target, 2.0)
    attack = _Attack(target, free_port())
    time.sleep(3.0)  # the streams' first sends block, the parts and joins wait
    result["refused_at_once"] = attack.ended()
    result["during"] = _snapshot(proc, target, during_s)
    result["normal_calls_during"] = _normal_calls(target, weights, version=1)
    attack.release()
    # Cancelled: every held handler returns at once, well before the timers; the threads the
    # attack started end once idle for IDLE_THREAD_S.
    time.sleep(IDLE_THREAD_S + 3.0)
    result["after"] = _snapshot(proc, target, 2.0)
    result["server"] = server_health(proc)
    # The same attack, then SIGTERM: how the stop ends and how long it takes.
    proc, target = start(*flags)
    attack = _Attack(target, free_port())
    time.sleep(3.0)
    signalled_s = time.monotonic()
    proc.send_signal(15)
    code = proc.wait(timeout=120)
    took_s = round(time.monotonic() - signalled_s, 2)
    left = [
        line.split("rollserve.server: ", 1)[-1]
        for line in proc.log_text().splitlines()
        if "rollserve.server: " in line and ("stopp" in line or "cancelled" in line)
    ]
    result["sigterm"] = {"exit_code": code, "took_s": took_s, "log": left}
    attack.release()
    during, after = result["during"], result["after"]
    ok = (
        during["max_ms"] < 1000
        and not during["failed"]
        and all(v.startswith("OK") for v in result["normal_calls_during"].values())
        # 3 (calls cancelled), or 4 when the engine's batch in progress outlasted the bound.
        and result["sigterm"]["exit_code"] in (0, 3, 4)
        and result["sigterm"]["took_s"] < _HELD_GRACE_S + STOP_BOUND_S + 2.0
        and after["max_ms"] < 1000
    )
    return result, ok


# ---- report -------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    lines = ["## Hardening soak (bench/soak.py)", ""]
    fuzz = results.get("fuzz")
    if fuzz:
        lines += [
            f"Fuzz: {fuzz['cases']} cases in {fuzz['seconds']} s; INTERNAL/UNKNOWN "
            f"{fuzz['internal_or_unknown']}, hangs {fuzz['hangs']}, crash {fuzz['crash']}, "
            f"slowest call {fuzz['slowest_call_s']} s; log-probs unchanged "
            f"{fuzz['log_probs_unchanged']}, versions {fuzz['version']} "
            f"({fuzz['accepted_updates']} streams accepted); {fuzz['server']}",
            "",
            "| category | cases | statuses |",
            "|---|---|---|",
        ]
        for category, codes in sorted(fuzz["by_category"].items()):
            shown = ", ".join(f"{c} {n}" for c, n in sorted(codes.items()))
            lines.append(f"| {category} | {sum(codes.values())} | {shown} |")
        lines.append("")
    cuts = results.get("cuts")
    if cuts:
        lines += [
            f"Cuts: {cuts['rounds']} rounds on a {cuts['model_bytes'] / MIB:.0f} MiB actor; "
            f"RSS baseline {cuts['rss_baseline_mib']} MiB, end {cuts['rss_end_mib']} MiB, "
            f"max over baseline {cuts['rss_max_over_baseline_mib']} MiB; failures "
            f"{len(cuts['failures'])}; {cuts['server']}",
            "",
            "| cut | client saw |",
            "|---|---|",
        ]
        for kind, codes in cuts["outcomes"].items():
            lines.append(f"| {kind} | {', '.join(f'{c} x{n}' for c, n in codes.items())} |")
        lines.append("")
    load = results.get("load")
    if load:
        lines += [
            f"Load: {load['clients']} clients ({load['roles']}) for {load['seconds']} s; "
            f"{load['updates_acknowledged']} updates, versions {load['versions']}; "
            f"{load['rows_checked']} rows' policy_version checked, violations "
            f"{len(load['version_violations'])}; RSS {load['rss_mib_at_5s']} MiB at 5 s, "
            f"{load['rss_mib_end']} MiB at the end (max {load['rss_mib_max']}); log-probs "
            f"unchanged {load['log_probs_unchanged']}; hung clients "
            f"{load['hung_client_threads']}; {load['server']}",
            "",
            "| RPC | calls | p50 ms | p99 ms | statuses |",
            "|---|---|---|---|---|",
        ]
        for rpc, row in load["latency"].items():
            shown = ", ".join(f"{c} {n}" for c, n in sorted(row["statuses"].items()))
            lines.append(
                f"| {rpc} | {row['calls']} | {row['p50_ms']} | {row['p99_ms']} | {shown} |"
            )
    held = results.get("held")
    if held:
        lines += [
            "",
            f"Held (send timeout, part wait and group cap {held['timers_s']} s): normal calls "
            f"during {held['normal_calls_during']}; refused at once "
            f"{Counter(held['refused_at_once'])}; SIGTERM during the attack: exit "
            f"{held['sigterm']['exit_code']} in {held['sigterm']['took_s']} s (grace "
            f"{held['grace_s']} s; {held['sigterm']['log']}); {held['server']}",
            "",
            "| when | probes | p50 ms | max ms | failed | threads | RSS MiB |",
            "|---|---|---|---|---|---|---|",
        ]
        for when in ("before", "during", "after"):
            row = held[when]
            lines.append(
                f"| {when} | {row['probes']} | {row['p50_ms']} | {row['max_ms']} | "
                f"{row['failed'] or 0} | {row['threads']} | {row['rss_mib']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fuzz-cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--cut-rounds", type=int, default=25)
    parser.add_argument("--load-s", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--update-every-s", type=float, default=3.0)
    parser.add_argument("--held-s", type=float, default=10.0, help="0: skip the held phase")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    results: dict = {}
    passed: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="rollserve-soak-") as tmp:
        workdir = Path(tmp)
        if args.fuzz_cases:
            results["fuzz"], passed["fuzz"] = phase_fuzz(workdir, args.fuzz_cases, args.seed)
            print(json.dumps(results["fuzz"], indent=1), flush=True)
        if args.cut_rounds:
            results["cuts"], passed["cuts"] = phase_cuts(workdir, args.cut_rounds)
            print(json.dumps(results["cuts"], indent=1), flush=True)
        if args.load_s:
            results["load"], passed["load"] = phase_load(
                workdir, args.load_s, args.clients, args.update_every_s
            )
            print(json.dumps(results["load"], indent=1), flush=True)
        if args.held_s:
            results["held"], passed["held"] = phase_held(workdir, args.held_s)
            print(json.dumps(results["held"], indent=1), flush=True)
    results["passed"] = passed
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print(markdown(results))
    print(f"\npassed: {passed}")
    return 0 if all(passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
