"""ReplicatedRolloutClient: one trainer, several rollout servers holding the same policy.

Experience calls are spread over the replicas (round robin or fewest calls in flight) and fail
over to another replica on UNAVAILABLE before any result arrived (MakeExperience is idempotent);
a weight update fans out to every replica in parallel and succeeds only when all of them serve
the new version.

Replicas come from a list of "host:port" targets, or from "dns:///name:port" targets resolved
into one replica per distinct address at construction and on `refresh()` (targets.py).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from .client import RolloutClient
from .protocol.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    RolloutError,
    Unavailable,
)
from .protocol.experience import Experience
from .protocol.requests import Prompts, UpdateOptions
from .protocol.results import HealthStatus, UpdateResult
from .targets import ReplicaAddress, as_target_list, resolve_addresses, resolve_targets
from .weights.distributed import WeightsGroup, group_of
from .weights.update_file import Weights, prepare_update

__all__ = [
    "POLICIES",
    "ReplicaHealth",
    "ReplicaUpdateError",
    "ReplicatedRolloutClient",
    "resolve_targets",
]

POLICIES = ("round_robin", "least_outstanding")
_TLS_OPTIONS = ("credentials", "root_certificates", "private_key", "certificate_chain")
T = TypeVar("T")


# ---- results and errors ------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaHealth:
    """One replica's Health answer, or the error that stood in its way."""

    target: str
    health: HealthStatus | None
    error: RolloutError | None

    @property
    def serving(self) -> bool:
        return self.health is not None and self.health.serving


def _describe(target: str, error: RolloutError) -> str:
    detail = error.details if error.details is not None else error.message
    return f"{target}: {error.code.name}: {detail}"


def _all_updated(version: int, answers: Mapping[str, object]) -> dict[str, UpdateResult]:
    """Every replica's result, or ReplicaUpdateError naming those that failed."""
    failures = {t: a for t, a in answers.items() if isinstance(a, RolloutError)}
    results = {t: a for t, a in answers.items() if not isinstance(a, RolloutError)}
    if failures:
        raise ReplicaUpdateError(version, failures, results)  # type: ignore[arg-type]
    return results  # type: ignore[return-value]


class ReplicaUpdateError(RolloutError):
    """A weight update that did not reach every replica.

    `failures` maps each failed replica to its error, `results` each updated one to its
    UpdateResult (those replicas now serve the new version). `code` is the failures' common
    status, or UNKNOWN when they differ.
    """

    def __init__(
        self,
        version: int,
        failures: Mapping[str, RolloutError],
        results: Mapping[str, UpdateResult],
    ) -> None:
        total = len(failures) + len(results)
        lines = "; ".join(_describe(t, e) for t, e in failures.items())
        super().__init__(
            f"weights version {version} reached {len(results)} of {total} replicas; failed: {lines}"
        )
        codes = {error.code for error in failures.values()}
        self.code = codes.pop() if len(codes) == 1 else grpc.StatusCode.UNKNOWN
        self.version = version
        self.failures = dict(failures)
        self.results = dict(results)


def _named(error: RolloutError, target: str) -> RolloutError:
    """The same error class and code, with a message that names the replica."""
    renamed = type(error)(f"replica {target}: {error.message}", details=error.details)
    renamed.code = error.code
    return renamed


# ---- the client --------------------------------------------------------------------------------


@dataclass(eq=False)
class _Replica:
    """Mutable routing state of one replica (guarded by the client's lock)."""

    address: ReplicaAddress
    client: RolloutClient
    outstanding: int = 0  # experience calls in flight
    calls: int = 0  # experience calls routed here, failed attempts included
    retired: bool = False  # dropped by refresh(); closed when its last call ends

    @property
    def target(self) -> str:
        return self.address.target


class ReplicatedRolloutClient:
    """Several rollout servers behind one client; thread-safe.

    `client_options` are RolloutClient's keyword arguments (timeout_s, token, metadata, TLS,
    ...), used for every replica. With TLS, replicas resolved from a DNS name check the server
    certificate against that name.
    """

    def __init__(
        self,
        targets: str | Sequence[str],
        *,
        policy: str = "round_robin",
        failover: bool = True,
        **client_options: Any,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.failover = failover
        self._specs = as_target_list(targets)
        self._options = dict(client_options)
        self._tls = any(self._options.get(name) is not None for name in _TLS_OPTIONS)
        self._lock = threading.Lock()
        self._replicas: dict[str, _Replica] = {}
        self._cursor = 0
        self.refresh()

    # -- membership

    def refresh(self) -> tuple[str, ...]:
        """Resolve the targets again: add new replicas, retire vanished ones; returns targets.

        A retired replica finishes its calls in flight, then closes. On a resolution error the
        replicas stay as they were.
        """
        resolved = resolve_addresses(self._specs)
        with self._lock:
            old = self._replicas
            self._replicas = {
                a.target: old[a.target] if a.target in old else self._open(a) for a in resolved
            }
            for target, replica in old.items():
                if target not in self._replicas:
                    replica.retired = True
                    self._close_if_idle(replica)
            return tuple(self._replicas)

    def _open(self, address: ReplicaAddress) -> _Replica:
        options = dict(self._options)
        if address.dns_name is not None:
            # Present the DNS name, not the IP, as :authority and as the TLS name to verify.
            extra: list[tuple[str, object]] = [("grpc.default_authority", address.authority)]
            if self._tls:
                extra.append(("grpc.ssl_target_name_override", address.dns_name))
            options["channel_options"] = [*extra, *options.get("channel_options", ())]
        return _Replica(address, RolloutClient(address.target, **options))

    @property
    def targets(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._replicas)

    @property
    def calls(self) -> dict[str, int]:
        """Experience calls routed to each replica so far (failed attempts included)."""
        with self._lock:
            return {target: r.calls for target, r in self._replicas.items()}

    @property
    def outstanding(self) -> dict[str, int]:
        """Experience calls in flight on each replica."""
        with self._lock:
            return {target: r.outstanding for target, r in self._replicas.items()}

    def client(self, target: str) -> RolloutClient:
        """The plain client of one replica (e.g. to pin a call to it)."""
        with self._lock:
            if target not in self._replicas:
                raise KeyError(f"no replica {target!r}; replicas: {list(self._replicas)}")
            return self._replicas[target].client

    # -- routing

    def _acquire(self, tried: set[str]) -> _Replica | None:
        """The next replica by policy among those not tried yet, marked as busy."""
        with self._lock:
            candidates = [r for r in self._replicas.values() if r.target not in tried]
            if not candidates:
                return None
            start = self._cursor % len(candidates)
            self._cursor += 1
            rotated = candidates[start:] + candidates[:start]
            # min() keeps the first of equals: ties go round robin.
            chosen = (
                min(rotated, key=lambda r: r.outstanding)
                if self.policy == "least_outstanding"
                else rotated[0]
            )
            chosen.outstanding += 1
            chosen.calls += 1
            tried.add(chosen.target)
            return chosen

    def _release(self, replica: _Replica) -> None:
        with self._lock:
            replica.outstanding -= 1
            self._close_if_idle(replica)

    @staticmethod
    def _close_if_idle(replica: _Replica) -> None:
        if replica.retired and replica.outstanding == 0:
            replica.client.close()

    def _all_unavailable(self, errors: Mapping[str, RolloutError]) -> Unavailable:
        lines = "; ".join(_describe(t, e) for t, e in errors.items())
        return Unavailable(f"no replica could take the call: {lines or 'no replicas'}")

    def make_experience(self, prompts: Prompts, *args: Any, **kwargs: Any) -> Experience:
        """RolloutClient.make_experience (same arguments) on the next replica; fails over on
        UNAVAILABLE."""
        tried: set[str] = set()
        errors: dict[str, RolloutError] = {}
        while (replica := self._acquire(tried)) is not None:
            try:
                return replica.client.make_experience(prompts, *args, **kwargs)
            except RolloutError as error:
                named = _named(error, replica.target)
                if not (self.failover and isinstance(error, Unavailable)):
                    raise named from None
                errors[replica.target] = named
            finally:
                self._release(replica)
        raise self._all_unavailable(errors)

    def stream_experience(
        self, prompts: Prompts, *args: Any, **kwargs: Any
    ) -> Iterator[Experience]:
        """RolloutClient.stream_experience (same arguments) on the next replica; fails over on
        UNAVAILABLE only before the first micro-batch (never mixing two replicas' rows in one
        stream)."""
        tried: set[str] = set()
        errors: dict[str, RolloutError] = {}
        while (replica := self._acquire(tried)) is not None:
            started = False
            try:
                with closing(replica.client.stream_experience(prompts, *args, **kwargs)) as stream:
                    for experience in stream:
                        started = True
                        yield experience
                return
            except RolloutError as error:
                named = _named(error, replica.target)
                if started or not (self.failover and isinstance(error, Unavailable)):
                    raise named from None
                errors[replica.target] = named
            finally:
                self._release(replica)
        raise self._all_unavailable(errors)

    # -- every replica

    def _chosen(self, replicas: Sequence[str] | None) -> list[_Replica]:
        with self._lock:
            if not self._replicas:
                raise Unavailable("no replicas: the client is closed")
            if replicas is None:
                return list(self._replicas.values())
            unknown = [t for t in replicas if t not in self._replicas]
            if unknown or not replicas:
                raise ValueError(f"unknown replicas {unknown}; replicas: {list(self._replicas)}")
            return [self._replicas[t] for t in dict.fromkeys(replicas)]

    @staticmethod
    def _fan_out(
        replicas: Sequence[_Replica], fn: Callable[[_Replica], T]
    ) -> dict[str, T | RolloutError]:
        """fn on every replica in parallel threads; RolloutErrors are returned, not raised."""

        def guarded(replica: _Replica) -> T | RolloutError:
            try:
                return fn(replica)
            except RolloutError as error:  # keyed by target below, so left unrenamed
                return error

        with ThreadPoolExecutor(len(replicas), thread_name_prefix="rollserve-fan-out") as pool:
            futures = {r.target: pool.submit(guarded, r) for r in replicas}
            return {target: future.result() for target, future in futures.items()}

    def health(self, *, timeout_s: float | None = None) -> dict[str, ReplicaHealth]:
        """Every replica's Health, asked in parallel; a replica that is down carries its error."""
        answers = self._fan_out(self._chosen(None), lambda r: r.client.health(timeout_s=timeout_s))
        return {
            target: ReplicaHealth(target, None, answer)
            if isinstance(answer, RolloutError)
            else ReplicaHealth(target, answer, None)
            for target, answer in answers.items()
        }

    def wait_until_ready(self, timeout_s: float = 60.0) -> dict[str, HealthStatus]:
        """Wait until every replica is SERVING; DeadlineExceeded naming those that are not."""
        answers = self._fan_out(self._chosen(None), lambda r: r.client.wait_until_ready(timeout_s))
        failed = {t: a for t, a in answers.items() if isinstance(a, RolloutError)}
        if failed:
            lines = "; ".join(_describe(t, e) for t, e in failed.items())
            raise DeadlineExceeded(f"{len(failed)} of {len(answers)} replicas not ready: {lines}")
        return answers  # type: ignore[return-value]

    def update_weights(
        self,
        weights: Weights,
        *,
        version: int,
        group: WeightsGroup | None = None,
        replicas: Sequence[str] | None = None,
        progress: Callable[[str, int, int], None] | None = None,
        options: UpdateOptions | None = None,
        **fields: Any,
    ) -> dict[str, UpdateResult]:
        """Stream the weights to every replica (or to `replicas`) in parallel threads (options:
        see RolloutClient.update_weights; with a `group`, one broadcast to its servers).

        Each stream reads the state dict on its own, so memory holds one chunk (and one host
        copy of the GPU tensor being read) per replica, never a whole serialized file.
        `progress(replica, sent_bytes, total_bytes)` is called from the streaming threads.
        Returns every replica's UpdateResult; raises ReplicaUpdateError unless all of them
        now serve `version` (retry the failed ones with `replicas=list(error.failures)`).
        """
        update = UpdateOptions.of(options, **fields)
        through = group_of(group, update.transport)
        if through is not None:
            results = through.update_weights(weights, version=version, options=update)
            return {c.target: r for c, r in zip(through.clients, results, strict=True)}
        # Bad weights fail here, once, before any stream opens (sha256 would hash it all).
        prepare_update(weights, version=version, options=dataclasses.replace(update, sha256=False))

        def push(replica: _Replica) -> UpdateResult:
            report = None if progress is None else _bind_progress(progress, replica.target)
            result = replica.client.update_weights(
                weights, version=version, progress=report, options=update
            )
            if result.version != version:
                raise FailedPrecondition(f"now serves version {result.version}, not {version}")
            return result

        return _all_updated(version, self._fan_out(self._chosen(replicas), push))

    def weights_group(self, **options: Any) -> WeightsGroup:
        """A WeightsGroup of this trainer and every replica: `update_weights(..., group=g)`
        then updates them all with one torch.distributed broadcast (options: WeightsGroup's)."""
        with self._lock:
            clients = [replica.client for replica in self._replicas.values()]
        return WeightsGroup(clients, **options)

    def close(self) -> None:
        """Close every replica's channel; calls still running are cancelled."""
        with self._lock:
            replicas, self._replicas = list(self._replicas.values()), {}
        for replica in replicas:
            replica.client.close()

    def __enter__(self) -> ReplicatedRolloutClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _bind_progress(
    progress: Callable[[str, int, int], None], target: str
) -> Callable[[int, int], None]:
    return lambda sent, total: progress(target, sent, total)
