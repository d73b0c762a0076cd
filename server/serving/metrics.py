"""Prometheus metrics of one server, in a registry of its own, served over HTTP on --metrics-port.

Each RolloutServer owns a CollectorRegistry (not prometheus_client's global one), so several
servers in one process (tests, benchmarks) keep separate numbers. What is exported:

  rollserve_rpc_handled_total{service,method,code}         calls finished, by status code
  rollserve_rpc_duration_seconds{service,method,code}      call latency (histogram)
  rollserve_rpc_rejected_total{service,method,code}        calls that ended with a non-OK status
  rollserve_rpc_in_flight{service,method}                  calls running now
  rollserve_rpc_received_bytes_total / _sent_bytes_total   serialized message bytes
  rollserve_generated_tokens_total                         response tokens streamed; tokens/s is
                                                           rate(rollserve_generated_tokens_total[1m])
  rollserve_micro_batch_rows, rollserve_request_rows       rows per streamed micro-batch / per
                                                           completed MakeExperience (histograms)
  rollserve_phase_seconds{phase}                           seconds of one completed MakeExperience
                                                           (or one Subscribe batch) in each phase:
                                                           generate, score_actor, score_reference,
                                                           score_critic, decode,
                                                           score_reward_model, rewards, shape
                                                           (histogram; phases that ran only)
  rollserve_generation_tokens_per_second                   its response tokens per second of
                                                           generation (histogram)
  rollserve_weight_updates_total{role,transport}, _weight_update_bytes_total{role},
  rollserve_weight_update_duration_seconds{role} (histogram),
  rollserve_weight_update_gigabytes_per_second{role,transport} the last update's throughput
  rollserve_update_phase_seconds{phase}                    seconds of one weight update in each
                                                           of its phases (weights/timings.py:
                                                           head, open, receive, finish,
                                                           swap_wait, apply, close, ...)
  rollserve_queue_depth, rollserve_policy_version{role},
  rollserve_phase{phase} (1 for the current one), rollserve_uptime_seconds   read at scrape time
  rollserve_device_memory_bytes{kind}                      the models' CUDA device as the
                                                           caching allocator sees it: allocated,
                                                           reserved, peak_allocated,
                                                           peak_reserved (the allocator's peaks);
                                                           read at scrape time, absent off CUDA
  rollserve_rollout_batches_{made,delivered,dropped_stale,failed}_total,
  rollserve_rollout_queued_batches, rollserve_rollout_subscribers, rollserve_rollout_epoch,
  rollserve_rollout_step, rollserve_rollout_finished   the continuous rollout (--rollout-prompts),
                                                       read at scrape time
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ...client.protocol.codec import decode_tensor
from ...client.protocol.roles import ROLE_NAMES as _ROLE_NAMES
from ...v1 import rollout_pb2 as pb
from ..experience.timing import PHASES, phase_key
from ..generation.compiling import eager_fallbacks
from ..state import Phase, ServerState

if TYPE_CHECKING:
    from ..continuous import RolloutStats

__all__ = [
    "MetricsHttpServer",
    "ServerMetrics",
    "device_memory_bytes",
    "role_name",
    "start_metrics_http",
]

_LOG = logging.getLogger(__name__)
_RPC = ("service", "method")
# Latency buckets from a 1 ms Health call up to a 10 min MakeExperience.
_DURATION_BUCKETS_S = (0.001, 0.005, 0.025, 0.1, 0.25, 1.0, 2.5, 10.0, 30.0, 60.0, 180.0, 600.0)
_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
_UPDATE_BUCKETS_S = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 180.0, 600.0)
# An update's phases run from microseconds (a reply) to the whole transfer (seconds).
_PHASE_BUCKETS_S = (1e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0)
_TOKENS_PER_S_BUCKETS = (10.0, 100.0, 1e3, 3e3, 1e4, 3e4, 1e5, 3e5, 1e6)


def role_name(role: int) -> str:
    """The role name ("actor", ...) of a wire ModelRole."""
    return _ROLE_NAMES.get(role, "unknown")


def split_method(full_method: str) -> tuple[str, str]:
    """("rollserve.v1.Rollout", "MakeExperience") from "/rollserve.v1.Rollout/MakeExperience"."""
    service, _, method = full_method.lstrip("/").partition("/")
    return service, method


class ServerMetrics:
    """Every metric of one server; the servicer and the interceptor record into it."""

    # Over 60 lines on purpose: one flat declaration per metric, in the order /metrics lists them.
    def __init__(self, state: ServerState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rpc_handled = Counter(
            "rollserve_rpc_handled", "RPCs finished", (*_RPC, "code"), registry=r
        )
        self.rpc_duration = Histogram(
            "rollserve_rpc_duration_seconds",
            "RPC latency from the handler's start to its last message",
            (*_RPC, "code"),
            buckets=_DURATION_BUCKETS_S,
            registry=r,
        )
        self.rpc_rejected = Counter(
            "rollserve_rpc_rejected",
            "RPCs that ended with a non-OK status",
            (*_RPC, "code"),
            registry=r,
        )
        self.rpc_in_flight = Gauge("rollserve_rpc_in_flight", "RPCs running", _RPC, registry=r)
        self.received_bytes = Counter(
            "rollserve_rpc_received_bytes", "serialized request bytes", _RPC, registry=r
        )
        self.sent_bytes = Counter(
            "rollserve_rpc_sent_bytes", "serialized response bytes", _RPC, registry=r
        )
        self.generated_tokens = Counter(
            "rollserve_generated_tokens", "response tokens in streamed experience", registry=r
        )
        self.micro_batch_rows = Histogram(
            "rollserve_micro_batch_rows",
            "rows per streamed micro-batch",
            buckets=_ROWS_BUCKETS,
            registry=r,
        )
        self.request_rows = Histogram(
            "rollserve_request_rows",
            "rows per completed MakeExperience",
            buckets=_ROWS_BUCKETS,
            registry=r,
        )
        self.phase_seconds = Histogram(
            "rollserve_phase_seconds",
            "seconds of one request (or rollout batch) in one phase of making experience",
            ("phase",),
            buckets=_DURATION_BUCKETS_S,
            registry=r,
        )
        self.generation_tokens_per_second = Histogram(
            "rollserve_generation_tokens_per_second",
            "response tokens per second of generation, per request (or rollout batch)",
            buckets=_TOKENS_PER_S_BUCKETS,
            registry=r,
        )
        self.weight_updates = Counter(
            "rollserve_weight_updates", "weight updates applied", ("role", "transport"), registry=r
        )
        self.weight_update_bytes = Counter(
            "rollserve_weight_update_bytes",
            "bytes of applied weight updates",
            ("role",),
            registry=r,
        )
        self.weight_update_duration = Histogram(
            "rollserve_weight_update_duration_seconds",
            "weight update time from the header to the swap",
            ("role",),
            buckets=_UPDATE_BUCKETS_S,
            registry=r,
        )
        self.weight_update_gbps = Gauge(
            "rollserve_weight_update_gigabytes_per_second",
            "throughput of the last weight update (1e9 bytes per second), per data plane",
            ("role", "transport"),
            registry=r,
        )
        self.update_phase_seconds = Histogram(
            "rollserve_update_phase_seconds",
            "seconds of one weight update in one of its phases on the server",
            ("phase",),
            buckets=_PHASE_BUCKETS_S,
            registry=r,
        )
        r.register(_StateCollector(state))

    def watch_rollout(self, stats: Callable[[], RolloutStats]) -> None:
        """Export the continuous rollout's counts, read from `stats()` at scrape time."""
        self.registry.register(_RolloutCollector(stats))

    def observe_experience(
        self, experience: pb.Experience, request: _PhaseTotals | None = None
    ) -> int:
        """Count the rows and generated tokens of one streamed Experience; returns its rows.

        Its phase timings add to `request` (one MakeExperience); without one, the Experience
        is a whole unit of work (a Subscribe batch) and they are observed now.
        """
        rows = int(experience.sequences.shape[0]) if experience.sequences.shape else 0
        self.micro_batch_rows.observe(rows)
        tokens = 0
        lengths = experience.info.get("response_length")
        if lengths is not None:
            # The generated lengths, not the action mask: dynamic sampling may zero a mask.
            tokens = int(decode_tensor(lengths, name="response_length").sum())
            self.generated_tokens.inc(tokens)
        totals = _PhaseTotals() if request is None else request
        totals.add(experience, tokens)
        if request is None:
            self.observe_phases(totals)
        return rows

    def observe_phases(self, totals: _PhaseTotals) -> None:
        """One request's seconds per phase (those that ran) and its generation rate."""
        for phase, seconds in totals.seconds.items():
            if seconds > 0:
                self.phase_seconds.labels(phase).observe(seconds)
        generate_s = totals.seconds.get("generate", 0.0)
        if generate_s > 0:
            self.generation_tokens_per_second.observe(totals.tokens / generate_s)

    def record_stream(
        self, responses: Iterator[pb.MakeExperienceResponse]
    ) -> Iterator[pb.MakeExperienceResponse]:
        """Pass a MakeExperience stream through, counting rows, tokens and phase seconds."""
        rows = 0
        totals = _PhaseTotals()
        for response in responses:
            rows += self.observe_experience(response.experience, totals)
            yield response
        self.request_rows.observe(rows)  # completed requests only
        self.observe_phases(totals)

    def observe_weight_update(self, response: pb.UpdateWeightsResponse) -> None:
        role = role_name(response.target)
        transport = response.transport or "grpc"
        self.weight_updates.labels(role, transport).inc()
        self.weight_update_bytes.labels(role).inc(response.bytes)
        self.weight_update_duration.labels(role).observe(response.seconds)
        gbps = response.bytes / max(response.seconds, 1e-9) / 1e9
        self.weight_update_gbps.labels(role, transport).set(gbps)

    def observe_update_phases(self, phases: Mapping[str, float]) -> None:
        """One weight update's seconds per phase (weights/timings.py; phases that ran)."""
        for phase, seconds in phases.items():
            self.update_phase_seconds.labels(phase).observe(seconds)

    def observe_rpc(self, full_method: str, code: str, duration_s: float) -> None:
        service, method = split_method(full_method)
        self.rpc_handled.labels(service, method, code).inc()
        self.rpc_duration.labels(service, method, code).observe(duration_s)
        if code != "OK":
            self.rpc_rejected.labels(service, method, code).inc()

    def observe_bytes(self, full_method: str, received: int, sent: int) -> None:
        service, method = split_method(full_method)
        self.received_bytes.labels(service, method).inc(received)
        self.sent_bytes.labels(service, method).inc(sent)


class _PhaseTotals:
    """Seconds per phase and generated tokens summed over the Experiences of one request: each
    row's info["time/<phase>_s"] is its share of its batch's seconds (rollout.proto)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.tokens = 0

    def add(self, experience: pb.Experience, tokens: int) -> None:
        self.tokens += tokens
        for phase in PHASES:
            tensor = experience.info.get(phase_key(phase))
            if tensor is not None:  # absent from servers that predate the timings
                seconds = float(decode_tensor(tensor, name=phase_key(phase)).double().sum())
                self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


class _StateCollector(Collector):
    """Values that live in ServerState, read when Prometheus scrapes (never stale)."""

    def __init__(self, state: ServerState) -> None:
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self._state
        yield GaugeMetricFamily(
            "rollserve_queue_depth", "requests waiting for the engine", value=state.queue_depth()
        )
        versions = GaugeMetricFamily(
            "rollserve_policy_version", "weights version per model", labels=["role"]
        )
        models = state.models
        for model in models.loaded() if models is not None else ():
            versions.add_metric([model.role], state.policy_version(model.role))
        yield versions
        phases = GaugeMetricFamily("rollserve_phase", "1 for the current phase", labels=["phase"])
        for phase in Phase:
            phases.add_metric([phase.value], 1.0 if state.phase is phase else 0.0)
        yield phases
        yield GaugeMetricFamily("rollserve_uptime_seconds", "since start", value=state.uptime_s)
        fallbacks = GaugeMetricFamily(
            "rollserve_eager_fallback",
            "1 for each function torch.compile failed on, which runs eagerly since (slower)",
            labels=["function"],
        )
        for name in eager_fallbacks():
            fallbacks.add_metric([name], 1.0)
        yield fallbacks
        if models is not None:
            memory = device_memory_bytes(models.device)
            if memory:
                family = GaugeMetricFamily(
                    "rollserve_device_memory_bytes",
                    "the models' device memory held by torch's caching allocator, by kind",
                    labels=["kind"],
                )
                for kind, count in memory.items():
                    family.add_metric([kind], float(count))
                yield family


def device_memory_bytes(device: torch.device) -> dict[str, int]:
    """What torch's caching allocator holds on `device`: allocated (live tensors), reserved
    (held from the driver, cached blocks included) and their peaks (since the process started,
    or since torch's reset_peak_memory_stats); empty off CUDA. Reads the allocator's counters
    only: no device work, safe from any thread while the engine runs."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return {}
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak_allocated": torch.cuda.max_memory_allocated(device),
        "peak_reserved": torch.cuda.max_memory_reserved(device),
    }


class _RolloutCollector(Collector):
    """The continuous rollout's counts, read when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], RolloutStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self._stats()
        prefix = "rollserve_rollout"
        for name, value, doc in (
            ("batches_made", s.made, "rollout batches made"),
            ("batches_delivered", s.delivered, "rollout batches sent to a subscriber"),
            ("batches_dropped_stale", s.dropped_stale, "rollout batches dropped as too stale"),
            ("batches_failed", s.failed, "rollout batches that failed and were skipped"),
        ):
            yield CounterMetricFamily(f"{prefix}_{name}", doc, value=value)
        for name, value, doc in (
            ("queued_batches", s.queued, "made rollout batches waiting for a subscriber"),
            ("subscribers", s.subscribers, "connected rollout subscribers"),
            ("epoch", s.epoch, "epoch of the last rollout batch finished"),
            ("step", s.step, "rollout batches finished (made or failed)"),
            ("finished", float(s.finished), "1 once every rollout batch was made and sent"),
        ):
            yield GaugeMetricFamily(f"{prefix}_{name}", doc, value=value)


class MetricsHttpServer:
    """prometheus_client's HTTP server thread for one registry; `close()` stops it."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.port: int = server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_http(
    registry: CollectorRegistry, host: str, port: int
) -> MetricsHttpServer | None:
    """Serve `registry` at http://host:port/metrics; None (and a warning) when it cannot bind.

    A metrics endpoint that cannot start must not keep the rollout service from serving.
    """
    try:
        server, thread = start_http_server(port, addr=host.strip("[]"), registry=registry)
    except OSError as exc:
        _LOG.warning("metrics endpoint off: cannot bind %s:%d: %s", host, port, exc)
        return None
    return MetricsHttpServer(server, thread)
