"""Security hardening against a real server process (tests/test_security.py covers auth and TLS).

One `rollserve serve` subprocess with both tokens, DEBUG logging, a metrics port, and a module on
its PYTHONPATH that leaves a file behind if anything ever imports it. Checked: no request field
(any string of MakeExperience, Subscribe, or the UpdateWeights header) makes the server import
code or open a connection to a URL; tokens and prompt text never reach the log, not even at
DEBUG and not through error messages; the metrics endpoint listens on --host only; and the token
comparison runs in constant time against both tokens.
"""

from __future__ import annotations

import hmac
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers_server import ServerProcess, free_port, start_server_process
from rollserve.server.serving import security
from rollserve.v1 import rollout_pb2 as pb

DATA_TOKEN = "data-Secr3t-7f1c"
ADMIN_TOKEN = "admin-Secr3t-99ab"
PROMPT_MARKER = "PromptTextMarker4821"
WAIT_S = 30.0
_MARKER_MODULE = """
import pathlib, sys
pathlib.Path(sys.argv[0]).parent  # noqa
pathlib.Path(__file__).with_suffix(".imported").write_text("imported")

def fn(*args, **kwargs):
    pathlib.Path(__file__).with_suffix(".called").write_text("called")
    return 1.0
"""


class ConnectionCounter:
    """A TCP listener that counts connections (a URL pointing here must never be fetched)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture(scope="module")
def marker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("marker")
    (directory / "rollserve_marker_mod.py").write_text(_MARKER_MODULE)
    return directory


@pytest.fixture(scope="module")
def listener() -> Iterator[ConnectionCounter]:
    counter = ConnectionCounter()
    yield counter
    counter.close()


@pytest.fixture(scope="module")
def server(tiny_actor_dir: Path, marker_dir: Path) -> Iterator[tuple[ServerProcess, str, int]]:
    metrics_port = free_port()
    proc, port = start_server_process(
        "--actor", str(tiny_actor_dir), "--device", "cpu", "--log-level", "DEBUG",
        "--metrics-port", str(metrics_port),
        "--data-token", DATA_TOKEN, "--admin-token", ADMIN_TOKEN,
        env={"PYTHONPATH": str(marker_dir)},
    )  # fmt: skip
    try:
        yield proc, f"127.0.0.1:{port}", metrics_port
    finally:
        proc.terminate_and_wait()


def _auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _hostile_strings(listener: ConnectionCounter) -> list[str]:
    url = f"http://127.0.0.1:{listener.port}/reward"
    return [
        url,
        f"reward={url}",
        "rollserve_marker_mod:fn",
        "rollserve_marker_mod",
        "marker=rollserve_marker_mod:fn",
        "__import__('rollserve_marker_mod')",
        "file:///etc/passwd",
    ]


def _make_experience_requests(strings: list[str]) -> Iterator[pb.MakeExperienceRequest]:
    for text in strings:
        request = pb.MakeExperienceRequest(samples_per_prompt=2, request_id=text)
        request.texts.texts.append(f"{PROMPT_MARKER} {text}")
        request.sampling.max_new_tokens = 2
        request.sampling.stop_strings.append(PROMPT_MARKER)
        request.gt_answers.append(PROMPT_MARKER)
        request.rewards.add(source=text)
        yield request
        for field in ("preset", "advantage_estimator", "kl_estimator", "kl_mode", "whitening"):
            mutated = pb.MakeExperienceRequest()
            mutated.CopyFrom(request)
            del mutated.rewards[:]
            mutated.rewards.add(source="exact_match")
            setattr(mutated.algorithm, field, text)
            yield mutated


def test_no_request_field_loads_code_or_calls_a_url(server, listener, marker_dir: Path) -> None:
    proc, target, _ = server
    strings = _hostile_strings(listener)
    codes = []
    with grpc.insecure_channel(target) as channel:
        make = channel.unary_stream(
            "/rollserve.v1.Rollout/MakeExperience",
            request_serializer=pb.MakeExperienceRequest.SerializeToString,
        )
        for request in _make_experience_requests(strings):
            try:
                list(make(request, metadata=_auth(DATA_TOKEN), timeout=WAIT_S))
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as error:
                codes.append(error.code())
        subscribe = channel.unary_stream(
            "/rollserve.v1.Rollout/Subscribe",
            request_serializer=pb.SubscribeRequest.SerializeToString,
        )
        for text in strings:
            with pytest.raises(grpc.RpcError) as info:
                list(subscribe(pb.SubscribeRequest(subscriber_id=text), metadata=_auth(DATA_TOKEN)))
            codes.append(info.value.code())
        update = channel.stream_unary(
            "/rollserve.v1.Rollout/UpdateWeights",
            request_serializer=pb.UpdateWeightsRequest.SerializeToString,
        )
        for text in strings:
            header = pb.WeightsHeader(version=10**6, total_bytes=100, sha256=text)
            header.manifest.add(name=text, dtype=pb.DTYPE_FLOAT32, shape=[1])
            with pytest.raises(grpc.RpcError) as info:
                update(iter([pb.UpdateWeightsRequest(header=header)]), metadata=_auth(ADMIN_TOKEN))
            codes.append(info.value.code())
    assert grpc.StatusCode.OK not in codes  # every hostile name is refused...
    assert grpc.StatusCode.INTERNAL not in codes and grpc.StatusCode.UNKNOWN not in codes
    assert listener.connections == 0  # ...without a connection to the URL...
    assert not list(marker_dir.glob("*.imported")) and not list(marker_dir.glob("*.called"))
    assert proc.poll() is None  # ...or importing the module


def test_tokens_and_prompt_text_never_reach_the_log(server) -> None:
    proc, target, _ = server
    with grpc.insecure_channel(target) as channel:
        make = channel.unary_stream(
            "/rollserve.v1.Rollout/MakeExperience",
            request_serializer=pb.MakeExperienceRequest.SerializeToString,
        )
        ok = pb.MakeExperienceRequest(samples_per_prompt=2)
        ok.texts.texts.append(f"say {PROMPT_MARKER}")
        ok.gt_answers.append(PROMPT_MARKER)
        ok.sampling.max_new_tokens = 2
        ok.sampling.stop_strings.append(PROMPT_MARKER)
        ok.rewards.add(source="exact_match")
        ok.outputs.response_texts = True
        list(make(ok, metadata=_auth(DATA_TOKEN), timeout=WAIT_S))  # served
        refused = [
            pb.MakeExperienceRequest(),  # no prompts
            pb.MakeExperienceRequest(samples_per_prompt=-1),
        ]
        refused[0].gt_answers.append(PROMPT_MARKER)
        refused[1].texts.texts.append(PROMPT_MARKER * 50_000)  # over the context
        bad_chat = pb.MakeExperienceRequest()
        bad_chat.texts.texts.append(PROMPT_MARKER)
        bad_chat.texts.apply_chat_template = True
        refused.append(bad_chat)
        metadata_variants = [
            _auth(DATA_TOKEN),
            _auth(DATA_TOKEN + "x"),  # a wrong token that contains the real one
            (("x-api-key", f"Bearer {ADMIN_TOKEN}"),),  # a token in the wrong header
            (("authorization", ADMIN_TOKEN),),  # no scheme
        ]
        for request in refused:
            for metadata in metadata_variants:
                with pytest.raises(grpc.RpcError):
                    list(make(request, metadata=metadata, timeout=WAIT_S))
    log = proc.log_text()
    assert "rpc method=rollserve.v1.Rollout/MakeExperience status=OK" in log  # it does log calls
    assert "DEBUG" in log  # at the most verbose level
    for secret in (DATA_TOKEN, ADMIN_TOKEN, PROMPT_MARKER):
        assert secret not in log, f"{secret} in the server log"


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, port_hex = local.partition(":")
            if state == "0A" and int(port_hex, 16) == port:
                found.add(address)
    return found


def test_metrics_listen_on_the_grpc_host_only(server) -> None:
    _, _, metrics_port = server
    # README/app.py: metrics are served over HTTP on --host; here 127.0.0.1, not every address.
    assert _listening_addresses(metrics_port) == {"0100007F"}  # 127.0.0.1, little-endian hex
    with socket.create_connection(("127.0.0.1", metrics_port), timeout=WAIT_S) as conn:
        conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        assert conn.recv(64).startswith(b"HTTP/1.0 200")


def test_token_comparison_is_constant_time_against_both_tokens(monkeypatch) -> None:
    calls = []
    compare_digest = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", spy)
    tokens = security.AuthTokens(data=DATA_TOKEN.encode(), admin=ADMIN_TOKEN.encode())
    method = "/rollserve.v1.Rollout/MakeExperience"
    for presented in (ADMIN_TOKEN, DATA_TOKEN, "x", ADMIN_TOKEN[:-1]):
        calls.clear()
        security.authorize(tokens, method, _auth(presented))
        # Both tokens compared every time, only with compare_digest (no ==, no early exit).
        assert sorted(b for _, b in calls) == sorted([DATA_TOKEN.encode(), ADMIN_TOKEN.encode()])


@pytest.mark.parametrize("method", ["InitWeightsGroup", "DestroyWeightsGroup"])
def test_weights_group_rpcs_need_the_admin_token(server, listener, method: str) -> None:
    # InitWeightsGroup makes the server connect to the address it names: admin only, like
    # UpdateWeights; a data token or none is refused before anything is dialled.
    _, target, _ = server
    request = (
        pb.InitWeightsGroupRequest(
            group="g",
            master_address="127.0.0.1",
            master_port=listener.port,
            world_size=2,
            rank=1,
            timeout_s=1.0,
        )  # fmt: skip
        if method == "InitWeightsGroup"
        else pb.DestroyWeightsGroupRequest(group="g")
    )
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(
            f"/rollserve.v1.Rollout/{method}", request_serializer=type(request).SerializeToString
        )
        for metadata, code in [
            ((), grpc.StatusCode.UNAUTHENTICATED),
            (_auth(DATA_TOKEN), grpc.StatusCode.PERMISSION_DENIED),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                call(request, metadata=metadata, timeout=WAIT_S)
            assert info.value.code() is code
    assert listener.connections == 0
