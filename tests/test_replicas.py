"""ReplicatedRolloutClient against two real server processes (started once, in parallel).

Versions tell the replicas apart on the server side: pushing a different version to each with
plain clients, then reading the policy_version stamped on every row, shows where each call ran.
A port where nothing listens stands in for a replica that is down. Membership changes on
refresh() use a scripted resolver (socket.getaddrinfo), the one dependency not under test; TLS
with a DNS name uses the scripted stand-in of tests/test_client.py.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import test_client
import torch
from helpers_server import ServerProcess, free_port, start_server_process
from rollserve.client.client import RolloutClient
from rollserve.client.protocol.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    RolloutError,
    Unavailable,
)
from rollserve.client.replicas import ReplicatedRolloutClient, ReplicaUpdateError, resolve_targets
from test_client import SCRIPTED_VERSION, WAIT_S, Pki

pki = test_client.pki
tls_server = test_client.tls_server

NORM = "model.norm.weight"  # (64,) in the tiny Llama: a cheap partial update
REQUEST = dict(max_new_tokens=3, seed=1, rewards=["exact_match"], gt_answers=["x"])
PROMPT = [[5, 6, 7]]


@pytest.fixture(scope="module")
def servers(tiny_actor_dir) -> Iterator[list[str]]:
    """Two real server processes on 127.0.0.1, as ["127.0.0.1:PORT_A", "127.0.0.1:PORT_B"]."""
    args = ("--device", "cpu", "--actor", str(tiny_actor_dir), "--log-level", "WARNING")
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(start_server_process, *args) for _ in range(2)]
    procs: list[ServerProcess] = []
    ports: list[int] = []
    errors = []
    for start in starts:
        try:
            proc, port = start.result()
            procs.append(proc)
            ports.append(port)
        except Exception as error:  # noqa: BLE001  (stop the other one before failing)
            errors.append(error)
    try:
        if errors:
            raise errors[0]
        yield [f"127.0.0.1:{port}" for port in ports]
    finally:
        for proc in procs:  # signal both first: they drain in parallel
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.terminate_and_wait()


def _versions(targets: list[str]) -> list[int]:
    versions = []
    for target in targets:
        with RolloutClient(target, timeout_s=WAIT_S) as client:
            versions.append(client.health().policy_version)
    return versions


def _norm(value: float) -> dict[str, torch.Tensor]:
    return {NORM: torch.full((64,), float(value))}


def _next_version(targets: list[str]) -> int:
    return max(_versions(targets)) + 1


def _dead_target() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


# ---- spreading calls --------------------------------------------------------------------------


def test_round_robin_alternates_between_replicas(servers: list[str]) -> None:
    a, b = servers
    version_a = _next_version(servers)
    for target, version in ((a, version_a), (b, version_a + 1)):
        with RolloutClient(target, timeout_s=WAIT_S) as client:
            client.update_weights(_norm(version), version=version, mode="partial")
    with ReplicatedRolloutClient(servers, timeout_s=WAIT_S) as replicas:
        assert replicas.targets == (a, b)
        stamped = [replicas.make_experience(PROMPT, **REQUEST).policy_version.item()]
        stamped += [e.policy_version.item() for e in replicas.stream_experience(PROMPT, **REQUEST)]
        stamped += [replicas.make_experience(PROMPT, **REQUEST).policy_version.item()]
        stamped += [replicas.make_experience(PROMPT, **REQUEST).policy_version.item()]
        assert replicas.calls == {a: 2, b: 2}
        assert replicas.outstanding == {a: 0, b: 0}
    assert stamped == [version_a, version_a + 1, version_a, version_a + 1]


def test_least_outstanding_avoids_the_busy_replica(servers: list[str]) -> None:
    a, b = servers
    with ReplicatedRolloutClient(servers, policy="least_outstanding", timeout_s=WAIT_S) as replicas:
        # Hold a stream open (two micro-batches; take one): its replica stays busy.
        stream = replicas.stream_experience(
            [[5, 6, 7], [8, 9]],
            micro_batch_size=1,
            algorithm={"whitening": "none"},
            **{**REQUEST, "gt_answers": ["x", "y"]},
        )
        next(stream)
        busy = next(t for t, n in replicas.outstanding.items() if n == 1)
        idle = b if busy == a else a
        for _ in range(2):
            replicas.make_experience(PROMPT, **REQUEST)
        assert replicas.calls == {busy: 1, idle: 2}
        stream.close()
        assert replicas.outstanding == {a: 0, b: 0}


# ---- every replica ----------------------------------------------------------------------------


def test_update_fans_out_to_every_replica(servers: list[str]) -> None:
    version = _next_version(servers)
    sent: dict[str, int] = {}
    with ReplicatedRolloutClient(servers, timeout_s=WAIT_S) as replicas:
        results = replicas.update_weights(
            _norm(0.5),
            version=version,
            mode="partial",
            progress=lambda target, done, total: sent.__setitem__(target, done),
        )
        assert set(results) == set(servers)
        assert all(r.version == version and r.tensors == 1 for r in results.values())
        assert sent == {t: r.bytes for t, r in results.items()}
        health = replicas.health()
        assert {t: h.health.policy_version for t, h in health.items()} == dict.fromkeys(
            servers, version
        )
        assert all(h.serving and h.error is None for h in health.values())
        ready = replicas.wait_until_ready(timeout_s=WAIT_S)
        assert set(ready) == set(servers)
        for _ in servers:
            assert replicas.make_experience(PROMPT, **REQUEST).policy_version.item() == version


def test_one_broadcast_updates_every_replica(servers: list[str]) -> None:
    version = _next_version(servers)
    with ReplicatedRolloutClient(servers, timeout_s=WAIT_S) as replicas:
        # 64-byte broadcasts: the 256-byte tensor takes both lanes (the default for gloo) twice.
        with replicas.weights_group(timeout_s=WAIT_S, bucket_bytes=64) as group:
            assert len(group.clients) == len(servers)  # ranks 1 and 2; the trainer is rank 0
            assert group.lanes == 2
            results = replicas.update_weights(
                _norm(0.25), version=version, mode="partial", group=group
            )
            assert set(results) == set(servers)
            assert {(r.version, r.transport) for r in results.values()} == {(version, "dist")}
            # A stale version: both servers vote no, nobody broadcasts, the group stays usable.
            with pytest.raises(FailedPrecondition, match="not above"):
                replicas.update_weights(_norm(0.5), version=version, mode="partial", group=group)
            results = replicas.update_weights(
                _norm(0.5), version=version + 1, mode="partial", group=group
            )
            assert {r.version for r in results.values()} == {version + 1}
    assert _versions(servers) == [version + 1] * len(servers)


def test_a_down_replica_is_named_and_the_others_still_update_and_serve(servers) -> None:
    dead = _dead_target()
    version = _next_version(servers)
    with ReplicatedRolloutClient([*servers, dead], timeout_s=WAIT_S) as replicas:
        health = replicas.health()
        assert not health[dead].serving and isinstance(health[dead].error, Unavailable)
        assert all(health[t].serving for t in servers)

        with pytest.raises(ReplicaUpdateError) as info:
            replicas.update_weights(_norm(0.25), version=version, mode="partial")
        error = info.value
        assert set(error.failures) == {dead} and set(error.results) == set(servers)
        assert error.code == grpc.StatusCode.UNAVAILABLE and isinstance(error, RolloutError)
        assert dead in str(error) and "UNAVAILABLE" in str(error)
        assert _versions(servers) == [version, version]

        with pytest.raises(ReplicaUpdateError):  # retrying just the failed one
            replicas.update_weights(_norm(0.25), version=version, replicas=list(error.failures))

        # Failover (the default): every call is served, by the live replicas.
        for _ in range(3):
            assert replicas.make_experience(PROMPT, **REQUEST).policy_version.item() == version
        assert replicas.calls[dead] >= 1

        with pytest.raises(DeadlineExceeded, match=dead):
            replicas.wait_until_ready(timeout_s=1)

    with ReplicatedRolloutClient([dead, *servers], failover=False, timeout_s=WAIT_S) as replicas:
        with pytest.raises(Unavailable) as down:
            replicas.make_experience(PROMPT, **REQUEST)
        assert f"replica {dead}" in str(down.value)
        assert replicas.make_experience(PROMPT, **REQUEST).policy_version.item() == version


def test_every_replica_down_is_unavailable_naming_each() -> None:
    dead = [_dead_target(), _dead_target()]
    with ReplicatedRolloutClient(dead, timeout_s=WAIT_S) as replicas:
        with pytest.raises(Unavailable) as info:
            replicas.make_experience(PROMPT, **REQUEST)
        with pytest.raises(Unavailable):
            list(replicas.stream_experience(PROMPT, **REQUEST))
    assert all(target in str(info.value) for target in dead)


def test_errors_other_than_unavailable_do_not_fail_over(servers: list[str]) -> None:
    with ReplicatedRolloutClient(servers, timeout_s=WAIT_S) as replicas:
        with pytest.raises(InvalidArgument) as info:
            replicas.make_experience(PROMPT, samples_per_prompt=0)
        assert sum(replicas.calls.values()) == 1
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "replica 127.0.0.1:" in str(info.value)


# ---- targets, DNS and refresh -----------------------------------------------------------------


def test_dns_targets_expand_and_duplicates_collapse(servers: list[str]) -> None:
    a, _ = servers
    port = a.rpartition(":")[2]
    expanded = resolve_targets(f"dns:///localhost:{port}")
    assert a in expanded
    with ReplicatedRolloutClient([f"dns:///localhost:{port}", a], timeout_s=WAIT_S) as replicas:
        assert replicas.targets == expanded
        assert replicas.health()[a].serving  # dialled by address, :authority is the name


def _scripted_resolver(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[str]]) -> None:
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in answers:
            return real(host, port, *args, **kwargs)
        if not answers[host]:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        stream = (socket.AF_INET, socket.SOCK_STREAM, 6, "")
        return [(*stream, (ip, port)) for ip in answers[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_refresh_adds_new_addresses_and_retires_vanished_ones(monkeypatch) -> None:
    answers = {"rollout.test": ["10.0.0.1", "10.0.0.2"]}
    _scripted_resolver(monkeypatch, answers)
    with ReplicatedRolloutClient("dns:///rollout.test:50051") as replicas:
        assert replicas.targets == ("10.0.0.1:50051", "10.0.0.2:50051")
        kept = replicas.client("10.0.0.2:50051")
        answers["rollout.test"] = ["10.0.0.2", "10.0.0.3", "10.0.0.3"]
        assert replicas.refresh() == ("10.0.0.2:50051", "10.0.0.3:50051")
        assert replicas.client("10.0.0.2:50051") is kept  # same channel, counters kept
        with pytest.raises(KeyError):
            replicas.client("10.0.0.1:50051")
        answers["rollout.test"] = []
        with pytest.raises(Unavailable, match="rollout.test"):
            replicas.refresh()
        assert replicas.targets == ("10.0.0.2:50051", "10.0.0.3:50051")  # unchanged


@pytest.mark.parametrize(
    ("targets", "options"),
    [
        ([], {}),
        ("dns:///rollout.test", {}),  # no port
        ("dns://8.8.8.8/rollout.test:50051", {}),  # custom DNS server
        ("127.0.0.1:1", {"policy": "random"}),
    ],
)
def test_bad_targets_and_policies_are_refused(targets, options) -> None:
    with pytest.raises(ValueError):
        ReplicatedRolloutClient(targets, **options)


def test_unknown_replicas_in_an_update_are_refused() -> None:
    with ReplicatedRolloutClient(["127.0.0.1:1"]) as replicas, pytest.raises(ValueError):
        replicas.update_weights(_norm(1.0), version=1, mode="partial", replicas=["10.9.9.9:1"])


def test_tls_replicas_from_a_dns_name_verify_that_name(tls_server, pki: Pki) -> None:
    # The certificate names "localhost" only; the replica is dialled at its IP address.
    servicer, port = tls_server
    options = dict(
        root_certificates=pki.ca, private_key=pki.client_key, certificate_chain=pki.client_chain
    )
    with ReplicatedRolloutClient(f"dns:///localhost:{port}", timeout_s=10, **options) as replicas:
        assert f"127.0.0.1:{port}" in replicas.targets
        health = replicas.health()[f"127.0.0.1:{port}"]
        assert health.serving and health.health.policy_version == SCRIPTED_VERSION
