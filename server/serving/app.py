"""Build and run the gRPC server: Rollout, grpc.health.v1 and reflection on one port.

Order of a start: bind and start serving first (health answers NOT_SERVING while models load, so
probes see a live but unready process), then load the models, run the readiness probe (a tiny
forward pass on the engine, readiness.py, then the generation engine's warm-up), then SERVING.
Order of a stop: NOT_SERVING everywhere, keep answering for `drain_delay_s` so load balancers
notice, then stop accepting calls and give in-flight ones `shutdown_grace_s` to finish; then
cancel what still runs and give its handlers and the engine STOP_BOUND_S to end. The exit code
says which of these it took (exit_codes.py): 0 drained, 3 calls cancelled, 4 work left behind;
in the last case the process leaves at once (os._exit) instead of waiting for stuck threads, and
a watchdog armed at the signal does the same if anything else holds the exit.

With --rollout-prompts the server also runs a continuous rollout (continuous/): the prompt file
is read when the server is built, the request template is checked once the models are loaded
(before SERVING), and the rollout stops when the drain delay ends, ending Subscribe streams.

Around every call: the telemetry interceptor (request id, access log, metrics) and the auth
interceptor (bearer tokens, security.py); TLS or mutual TLS when configured. Prometheus metrics
are served over plain HTTP on `--metrics-port` (same host; 0 turns them off).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ...v1 import rollout_pb2 as pb
from ..config import ServerConfig
from ..continuous import ContinuousRollout
from ..engine.readiness import Readiness
from ..engine.runtime import Runtime
from ..experience.maker import NaiveExperienceMaker
from ..experience.request import RequestDefaults
from ..experience.rewards import RewardRegistry
from ..generation import GenerationSettings
from ..models import ModelSet, check_model_dirs, load_models
from ..state import Phase, ServerState
from ..weights import WeightUpdates
from .exit_codes import STOP_BOUND_S, ExitCode
from .handlers import add_rollout_servicer
from .interceptors import (
    PROBE_THREADS,
    AuthInterceptor,
    CallLimitInterceptor,
    MalformedRequestInterceptor,
    SendDeadlines,
    TelemetryInterceptor,
)
from .metrics import MetricsHttpServer, ServerMetrics, start_metrics_http
from .security import (
    AuthTokens,
    load_tokens,
    security_warnings,
    server_credentials,
)
from .servicer import RolloutServicer, generation_facts
from .thread_pool import ShrinkingThreadPool

__all__ = ["BindError", "RolloutServer", "ROLLOUT_SERVICE", "grpc_server_options", "serve"]

_LOG = logging.getLogger("rollserve.server")
# After the last work call's handler returned: how long its reply may take to go out.
FLUSH_S = 1.0
# gRPC's cancel of the calls left after the grace comes this much after our own decision.
CANCEL_AFTER_S = 0.5
ROLLOUT_SERVICE = pb.DESCRIPTOR.services_by_name["Rollout"].full_name  # "rollserve.v1.Rollout"
_HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# grpc.health.v1 names: "" is the whole server (what Kubernetes and grpc_health_probe ask).
_HEALTH_NAMES = ("", ROLLOUT_SERVICE)
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class BindError(RuntimeError):
    """The address could not be bound (in use, bad host, no permission), or the bound port could
    not be written to --port-file."""


def grpc_server_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Channel arguments of the server."""
    return [
        # Finite on purpose: bulk data streams in ~1 MiB messages, never one giant message.
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # Accept the clients' keepalive pings (every 30 s) on long streams, even when idle.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        # grpc enables SO_REUSEPORT by default: a second server on a busy port would then
        # "succeed" and split traffic with the first. Fail loudly instead.
        ("grpc.so_reuseport", 0),
    ]


class RolloutServer:
    """One rollout server: `start() -> port`, `stop(grace_s)`, `wait()`; usable in-process."""

    def __init__(self, config: ServerConfig, *, models: ModelSet | None = None) -> None:
        # `models`: already loaded models to serve (tests share one set between servers).
        self.config = config
        self.state = ServerState(config)
        self.port: int | None = None
        self._preloaded = models
        # The engine and the weight updater, once the models are loaded (None before).
        self.runtime: Runtime | None = None
        self.updates: WeightUpdates | None = None
        self._server: grpc.Server | None = None
        self._servicer: RolloutServicer | None = None
        self._health = health.HealthServicer()
        self.state.on_phase_change(self._mirror_health)
        self.metrics = ServerMetrics(self.state)
        self.readiness = Readiness(self.state)
        # Reads the prompt file now: a bad one fails before anything is bound.
        self.rollout = ContinuousRollout.from_config(self.state)
        if self.rollout is not None:
            self.metrics.watch_rollout(self.rollout.stats)
        self._metrics_http: MetricsHttpServer | None = None
        self._stop_lock = threading.Lock()
        self._stopped: ExitCode | None = None  # how the stop ended, once it did
        self._stopping = False
        self.send_deadlines: SendDeadlines | None = None
        self.call_limit: CallLimitInterceptor | None = None
        self.pool: ShrinkingThreadPool | None = None

    def start(self) -> int:
        """Bind, load the models and report SERVING; returns the bound port."""
        port = self.bind()
        self.load()
        return port

    def bind(self) -> int:
        """Start answering on the configured address (NOT_SERVING until `load` finishes)."""
        config = self.config
        # Both read files and raise SecurityConfigError before anything is bound.
        tokens = load_tokens(config)
        credentials = server_credentials(config)
        for name in _HEALTH_NAMES:
            self._health.set(name, _NOT_SERVING)
        self.send_deadlines = SendDeadlines(config.stream_send_timeout_s)
        self.call_limit = CallLimitInterceptor(config.max_workers, self.send_deadlines)
        # --max-workers calls at once (call_limit), plus threads that only probes can find free:
        # a probe answers while every other call holds its thread. Threads a burst of calls
        # started end once idle (thread_pool.py).
        self.pool = ShrinkingThreadPool(
            config.max_workers + PROBE_THREADS, thread_name_prefix="rollserve-rpc"
        )
        server = grpc.server(
            self.pool,  # type: ignore[arg-type]  # grpc only calls submit()
            options=grpc_server_options(config),
            # Telemetry first (outermost): calls refused by auth or the limit are logged and
            # counted too. Undecodable requests last (innermost): INVALID_ARGUMENT, not grpc's
            # INTERNAL.
            interceptors=(
                TelemetryInterceptor(self.metrics),
                AuthInterceptor(tokens),
                self.call_limit,
                MalformedRequestInterceptor(),
            ),
        )
        servicer = RolloutServicer(self.state, metrics=self.metrics, rollout=self.rollout)
        add_rollout_servicer(servicer, server)
        self._servicer = servicer
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (ROLLOUT_SERVICE, _HEALTH_SERVICE, reflection.SERVICE_NAME), server
        )
        self.port = _bind(server, config.host, config.port, credentials)
        server.start()
        self._server = server
        if config.metrics_port:
            self._metrics_http = start_metrics_http(
                self.metrics.registry, config.host, config.metrics_port
            )
        if config.port_file is not None:
            _write_port_file(Path(config.port_file), self.port)
        self._log_listening(tokens)
        return self.port

    def _log_listening(self, tokens: AuthTokens) -> None:
        config = self.config
        transport = "plaintext" if config.tls_cert is None else "TLS"
        if config.tls_client_ca is not None:
            transport = "mutual TLS"
        _LOG.info(
            "listening on %s (%s, auth %s, metrics %s; not serving until models load)",
            self.address,
            transport,
            "on" if tokens.enabled else "off",
            f"on port {self.metrics_port}" if self.metrics_port else "off",
        )
        for warning in security_warnings(config, tokens):
            _LOG.warning("%s", warning)

    def load(self) -> None:
        """Load the models (unless given) and move to SERVING or WAITING_FOR_WEIGHTS."""
        started_s = time.monotonic()
        models = self._preloaded if self._preloaded is not None else load_models(self.config)
        self.state.set_models(models)
        self.runtime, self.updates = build_runtime(self.state, models, self.readiness)
        if self._servicer is not None:
            self._servicer.serve_models(self.runtime, self.updates)
        # ReadinessError: never report SERVING on broken models.
        self.readiness.check_startup(self.runtime.engine, warm_up=self.runtime.maker.warm_up)
        if self.rollout is not None:
            self.rollout.start(self.runtime)  # RolloutSetupError on a bad template
        ready = Phase.WAITING_FOR_WEIGHTS if self.config.wait_for_weights else Phase.SERVING
        self.state.set_phase(ready)
        actor = models.actor
        path, kv_tokens = generation_facts(self.state)
        _LOG.info(
            "rollserve ready on %s: %s, actor %s (%s, %s, %d params) on %s, generation path %s "
            "(KV cache %d tokens), loaded in %.1f s",
            self.address,
            ready.value,
            actor.source,
            actor.architecture,
            actor.dtype,
            actor.num_parameters,
            models.device_label,
            path,
            kv_tokens,
            time.monotonic() - started_s,
        )

    def stop(self, grace_s: float | None = None, *, drain_delay_s: float = 0.0) -> ExitCode:
        """Report NOT_SERVING, wait drain_delay_s, then stop with grace_s for in-flight calls
        and STOP_BOUND_S more for what had to be cancelled; returns how it ended (a second call
        returns at once: the first one's outcome, DRAINED while it is still stopping)."""
        with self._stop_lock:
            if self._stopping:
                return ExitCode.DRAINED if self._stopped is None else self._stopped
            self._stopping = True
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        self.state.set_phase(Phase.DRAINING)
        outcome = ExitCode.DRAINED
        if self._server is not None:
            if drain_delay_s > 0:
                _LOG.info("draining: NOT_SERVING for %.1f s before refusing calls", drain_delay_s)
                time.sleep(drain_delay_s)
            if self.rollout is not None:
                self.rollout.close()  # Subscribe streams end instead of holding the grace period
            _LOG.info("stopping: in-flight calls get %.1f s", grace_s)
            outcome = self._stop_calls(self._server, grace_s)
        self._stopped = outcome
        return outcome

    def _stop_calls(self, server: grpc.Server, grace_s: float) -> ExitCode:
        """Stop gRPC (calls running at the end of the grace are cancelled), then the engine;
        each wait bounded, so the outcome is known within grace_s + STOP_BOUND_S."""
        grace_ends_s = time.monotonic() + grace_s
        deadline_s = grace_ends_s + STOP_BOUND_S
        # gRPC's own cancel comes CANCEL_AFTER_S later than the grace: the decision drained or
        # not is ours (at grace_s), never a race with gRPC cancelling a call that then returns
        # in time to look drained (exit 0 for a cancelled call).
        shutdown = server.stop(grace_s + CANCEL_AFTER_S)  # returns at once
        assert self.call_limit is not None  # bound with the server
        in_flight = self.call_limit.in_flight
        drained = in_flight.wait_idle(grace_s)
        if drained:
            # A handler that returned has not always sent its reply yet: stop(0) now would
            # cancel it (the client sees UNAVAILABLE "Cancelling all calls" for an update that
            # was applied). gRPC's own shutdown ends once every call is done; a grpc.health.v1
            # Watch never is, so wait at most FLUSH_S (and never past the grace).
            shutdown.wait(max(min(FLUSH_S, grace_ends_s - time.monotonic()), 0.0))
        else:
            _LOG.warning(
                "%d calls were still running when the grace period ended: cancelled",
                in_flight.count,
            )
            if self.updates is not None:
                # A part waiting for its part 0 that has read its first message does not see
                # the cancel until its wait ends: end the wait.
                self.updates.planes.parallel.stop_waiting()
        # Cancel what still runs: work calls past the grace, grpc.health.v1 Watch, reflection.
        server.stop(0)
        returned = drained or in_flight.wait_idle(deadline_s - time.monotonic())
        shutdown.wait(max(deadline_s - time.monotonic(), 0.0))
        if self.send_deadlines is not None:
            self.send_deadlines.close()
        engine_stopped = True
        if self.runtime is not None:
            # The engine's job in progress (the rollout's batch, say) may use what is left of
            # the grace too.
            self.runtime.close(timeout_s=max(deadline_s - time.monotonic(), 0.0))
            engine_stopped = self.runtime.engine.stopped
        updates_ended = True
        if self.updates is not None:
            updates_ended = self.updates.close(wait_s=max(deadline_s - time.monotonic(), 0.0))
        if self._metrics_http is not None:
            self._metrics_http.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False)  # idle handler threads end before the process does
        if not (returned and engine_stopped and updates_ended):
            _LOG.warning(
                "stopped, leaving behind what did not end within %.1f s of the grace: %s",
                STOP_BOUND_S,
                ", ".join(
                    ([f"{in_flight.count} call handlers"] if not returned else [])
                    + (["the engine's job in progress"] if not engine_stopped else [])
                    + (["weights-group rendezvous in torch"] if not updates_ended else [])
                ),
            )
            return ExitCode.ABANDONED
        outcome = ExitCode.DRAINED if drained else ExitCode.CANCELLED
        _LOG.info("stopped (%s)", "drained" if drained else "in-flight calls cancelled")
        return outcome

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the server stops (or timeout_s passes); True when it stopped."""
        if self._server is None:
            return True
        timed_out = self._server.wait_for_termination(timeout_s)  # grpc returns "timed out"
        return not timed_out

    @property
    def address(self) -> str:
        return f"{_host_for_address(self.config.host)}:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        """The port of the Prometheus endpoint; None when it is off or could not bind."""
        return None if self._metrics_http is None else self._metrics_http.port

    def __enter__(self) -> RolloutServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop(0)

    def _mirror_health(self, phase: Phase) -> None:
        if phase is Phase.DRAINING:
            # Permanent NOT_SERVING for every name; later set() calls are ignored.
            self._health.enter_graceful_shutdown()
            return
        serving = phase is Phase.SERVING
        status = health_pb2.HealthCheckResponse.SERVING if serving else _NOT_SERVING
        for name in _HEALTH_NAMES:
            self._health.set(name, status)


def build_runtime(
    state: ServerState, models: ModelSet, readiness: Readiness | None = None
) -> tuple[Runtime, WeightUpdates]:
    """The engine with its experience maker, and the weight updater whose swaps it runs, for
    loaded models, configured from the flags; `readiness` probes each model right after its
    weights are updated."""
    config = state.config
    rewards = RewardRegistry.from_specs(
        config.reward_fn, config.reward_endpoint, timeout_s=config.reward_timeout_s
    )
    defaults = RequestDefaults.from_config(config, default_preset=state.default_preset)
    maker = NaiveExperienceMaker(
        models,
        rewards,
        defaults,
        policy_version=state.policy_version,
        generation=GenerationSettings.from_config(config),
    )
    after_update = None if readiness is None else readiness.check_updated
    runtime = Runtime(state, maker, after_update=after_update)
    return runtime, WeightUpdates.for_models(models, state, runtime.swap)


def _host_for_address(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _bind(
    server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None
) -> int:
    address = f"{_host_for_address(host)}:{port}"
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpcio raises on failure; older versions returned 0
        raise BindError(f"cannot bind {address}: {exc}") from None
    if bound == 0:
        raise BindError(f"cannot bind {address}")
    return bound


def _write_port_file(path: Path, port: int) -> None:
    # Write then rename, so a reader polling for the file never sees it half written.
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(f"{port}\n")
        os.replace(tmp, path)
    except OSError as exc:
        # A missing folder or a directory at `path`: the CLI's one-line error (it was a
        # traceback), after serve() stopped the server it had started.
        tmp.unlink(missing_ok=True)
        raise BindError(f"port_file: cannot write {path}: {exc}") from None


class _StopWhileLoading(BaseException):
    """Raised by the signal handler to abandon a model load; nothing is in flight yet."""


def serve(config: ServerConfig) -> int:
    """Run a server until SIGTERM/SIGINT, then drain and stop gracefully; returns the exit code
    (exit_codes.py), or leaves the process at once when work had to be left behind.

    Raises ModelLoadError or BindError for startup failures (the CLI prints them).
    """
    _configure_logging(config.log_level)
    check_model_dirs(config)
    server = RolloutServer(config)
    stop_requested = threading.Event()
    # Everything a stop may take, plus as much again for what follows it (closing the models,
    # the interpreter's exit): past this the process leaves whatever holds it.
    exit_by_s = config.drain_delay_s + config.shutdown_grace_s + 2 * STOP_BOUND_S

    def on_signal(signum: int, frame: FrameType | None) -> None:
        _LOG.info("received %s", signal.Signals(signum).name)
        if not stop_requested.is_set():
            stop_requested.set()
            _exit_after(exit_by_s)
        if server.state.phase is Phase.LOADING:
            raise _StopWhileLoading()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.start()
        while not stop_requested.wait(1.0):
            pass
    except _StopWhileLoading:
        _LOG.info("stop requested while loading models")
        server.stop(0)
        return ExitCode.DRAINED
    except BaseException:
        server.stop(0)
        raise
    outcome = server.stop(config.shutdown_grace_s, drain_delay_s=config.drain_delay_s)
    if outcome is ExitCode.ABANDONED:
        # A stuck pool thread would hold the interpreter's exit, the engine thread inside a
        # torch op would abort it (std::terminate): leave now.
        _exit_now(outcome)
    return outcome


def _exit_after(seconds: float) -> None:
    """Leave the process with ABANDONED if it is still running `seconds` from now."""

    def watch() -> None:
        time.sleep(seconds)
        _LOG.error("still running %.1f s after the stop began: leaving without waiting", seconds)
        _exit_now(ExitCode.ABANDONED)

    threading.Thread(target=watch, name="rollserve-exit-watchdog", daemon=True).start()


def _exit_now(code: ExitCode) -> None:
    """os._exit after flushing the logs and standard streams (os._exit flushes nothing)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(int(code))


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
