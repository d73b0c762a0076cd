"""TLS, mutual TLS and bearer-token roles, against a real server process and in-process servers.

Certificates are made here with `cryptography`: a CA, a server certificate for 127.0.0.1 and
localhost, a client certificate, and a second ("rogue") CA whose client certificate the server
must refuse. One module-scoped process runs with mutual TLS and both tokens (the data token from
a file, the admin token from the environment); a TLS-only server runs in-process.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import safetensors.torch
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from helpers_server import ServerProcess
from rollserve.server.config import ServerConfig
from rollserve.server.serving.security import (
    AuthTokens,
    Role,
    SecurityConfigError,
    authorize,
    is_loopback,
    load_tokens,
    required_role,
    security_warnings,
    server_credentials,
)
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

DATA_TOKEN = "data-7c1f0a9e"
ADMIN_TOKEN = "admin-52be11d4"
WAIT_S = 60.0  # bound on any wait; never reached when things work
SERVING = health_pb2.HealthCheckResponse.SERVING


# ---- certificates ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Certs:
    ca: bytes
    server_cert: bytes
    server_key: bytes
    client_cert: bytes
    client_key: bytes
    rogue_client_cert: bytes  # signed by a CA the server does not trust
    rogue_client_key: bytes
    files: dict[str, Path]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject, key, issuer, issuer_key, *, ca: bool, san=None, client=False):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if not ca:
        usage = x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH if client else None
        usage = usage or x509.oid.ExtendedKeyUsageOID.SERVER_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_certs(directory: Path) -> Certs:
    keys = {
        name: ec.generate_private_key(ec.SECP256R1()) for name in ("ca", "rogue", "s", "c", "r")
    }
    ca = _certificate("test-ca", keys["ca"], "test-ca", keys["ca"], ca=True)
    rogue_ca = _certificate("rogue-ca", keys["rogue"], "rogue-ca", keys["rogue"], ca=True)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = _certificate("127.0.0.1", keys["s"], "test-ca", keys["ca"], ca=False, san=san)
    client = _certificate("trainer", keys["c"], "test-ca", keys["ca"], ca=False, client=True)
    rogue = _certificate("intruder", keys["r"], "rogue-ca", keys["rogue"], ca=False, client=True)
    del rogue_ca  # only its key signs the rogue client certificate
    contents = {
        "ca.pem": _pem(ca),
        "server.pem": _pem(server),
        "server.key": _pem_key(keys["s"]),
        "client.pem": _pem(client),
        "client.key": _pem_key(keys["c"]),
    }
    files = {}
    for name, data in contents.items():
        files[name] = directory / name
        files[name].write_bytes(data)
    return Certs(
        ca=contents["ca.pem"],
        server_cert=contents["server.pem"],
        server_key=contents["server.key"],
        client_cert=contents["client.pem"],
        client_key=contents["client.key"],
        rogue_client_cert=_pem(rogue),
        rogue_client_key=_pem_key(keys["r"]),
        files=files,
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def client_credentials(certs: Certs, *, client: str | None = "good") -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=certs.ca)
    key, cert = (certs.client_key, certs.client_cert)
    if client == "rogue":
        key, cert = (certs.rogue_client_key, certs.rogue_client_cert)
    return grpc.ssl_channel_credentials(
        root_certificates=certs.ca, private_key=key, certificate_chain=cert
    )


def health_check(channel: grpc.Channel, timeout_s: float = 10.0) -> int:
    request = health_pb2.HealthCheckRequest(service="")
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout_s).status


# ---- the mutual-TLS, token-protected server process ---------------------------------------------


def start_secure_process(
    certs: Certs, *args: str, env: dict[str, str]
) -> tuple[ServerProcess, int]:
    """Like helpers_server.start_server_process, but waits for SERVING over mutual TLS."""
    workdir = Path(tempfile.mkdtemp(prefix="rollserve-secure-"))
    port_file = workdir / "port"
    command = [sys.executable, "-m", "rollserve.server", "serve", "--host", "127.0.0.1"]
    command += ["--port", "0", "--port-file", str(port_file), "--metrics-port", "0", *args]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSERVE_")}
    full_env.update(PYTHONUNBUFFERED="1", **env)
    log_path = workdir / "server.log"
    with open(log_path, "wb") as log:
        proc = ServerProcess(command, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log_path
    deadline_s = time.monotonic() + 120
    try:
        while time.monotonic() < deadline_s:
            assert proc.poll() is None, f"server exited during start-up:\n{proc.log_text()}"
            if port_file.exists():
                port = int(port_file.read_text())
                with grpc.secure_channel(f"127.0.0.1:{port}", client_credentials(certs)) as ch:
                    try:
                        if health_check(ch, timeout_s=2.0) == SERVING:
                            return proc, port
                    except grpc.RpcError:
                        pass
            time.sleep(0.2)
        raise TimeoutError(f"secure server did not serve:\n{proc.log_text()}")
    except BaseException:
        proc.kill()
        proc.wait()
        raise


@pytest.fixture(scope="module")
def secure_server(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    token_file = tmp_path_factory.mktemp("tokens") / "data-token"
    token_file.write_text(DATA_TOKEN + "\n")  # a trailing newline, as editors and echo write
    files = certs.files
    proc, port = start_secure_process(
        certs,
        "--device", "cpu",
        "--tls-cert", str(files["server.pem"]),
        "--tls-key", str(files["server.key"]),
        "--tls-client-ca", str(files["ca.pem"]),
        "--data-token-file", str(token_file),
        env={"ROLLSERVE_ADMIN_TOKEN": ADMIN_TOKEN},
    )  # fmt: skip
    yield proc, f"127.0.0.1:{port}"
    assert proc.terminate_and_wait() == 0, proc.log_text()


@pytest.fixture
def secure_channel(certs: Certs, secure_server) -> Iterator[grpc.Channel]:
    with grpc.secure_channel(secure_server[1], client_credentials(certs)) as channel:
        yield channel


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    return () if token is None else (("authorization", f"Bearer {token}"),)


def call_code(function, *args, **kwargs) -> grpc.StatusCode:
    """The status code of a call (OK when it succeeds); streams are read to the end."""
    try:
        result = function(*args, **kwargs)
        if hasattr(result, "__iter__") and not isinstance(result, pb.UpdateWeightsResponse):
            list(result)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def tiny_request() -> pb.MakeExperienceRequest:
    return pb.MakeExperienceRequest(
        token_ids=pb.RaggedTokenIds(values=[5, 6, 7], lengths=[3]),
        sampling=pb.SamplingOptions(max_new_tokens=2, seed=1),
        rewards=[pb.RewardTerm(source="exact_match")],
        gt_answers=["x"],
    )


def weight_update(version: int) -> list[pb.UpdateWeightsRequest]:
    """A partial actor update of one small tensor (the final norm), as one chunk."""
    data = safetensors.torch.save({"model.norm.weight": torch.full((64,), 1.0 + version / 100)})
    header = pb.WeightsHeader(
        target=pb.MODEL_ROLE_ACTOR,
        version=version,
        mode=pb.UPDATE_MODE_PARTIAL,
        total_bytes=len(data),
    )
    return [
        pb.UpdateWeightsRequest(header=header),
        pb.UpdateWeightsRequest(chunk=pb.WeightsChunk(offset=0, data=data)),
    ]


def test_mutual_tls_health_and_reflection_need_no_token(secure_channel: grpc.Channel) -> None:
    assert health_check(secure_channel) == SERVING
    services = set(ProtoReflectionDescriptorDatabase(secure_channel).get_services())
    assert {"rollserve.v1.Rollout", "grpc.health.v1.Health"} <= services


@pytest.mark.parametrize("client", [None, "rogue", "plaintext"])
def test_mutual_tls_refuses_clients_without_a_trusted_certificate(
    certs: Certs, secure_server, client: str | None
) -> None:
    target = secure_server[1]
    if client == "plaintext":
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, client_credentials(certs, client=client))
    with channel, pytest.raises(grpc.RpcError) as info:
        health_check(channel, timeout_s=5.0)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        (None, grpc.StatusCode.UNAUTHENTICATED),
        ("wrong-token", grpc.StatusCode.UNAUTHENTICATED),
        (DATA_TOKEN + "x", grpc.StatusCode.UNAUTHENTICATED),
        (DATA_TOKEN, grpc.StatusCode.OK),
        (ADMIN_TOKEN, grpc.StatusCode.OK),  # the admin token opens the data plane too
    ],
)
def test_data_plane_calls_need_a_valid_token(
    secure_channel: grpc.Channel, token: str | None, expected: grpc.StatusCode
) -> None:
    stub = rollout_pb2_grpc.RolloutStub(secure_channel)
    metadata = bearer(token)
    assert call_code(stub.Health, pb.HealthRequest(), metadata=metadata, timeout=WAIT_S) == expected
    code = call_code(stub.MakeExperience, tiny_request(), metadata=metadata, timeout=WAIT_S)
    assert code == expected


@pytest.mark.parametrize("rpc", ["UpdateWeights", "UpdateWeightsAtOnce"])
def test_update_weights_needs_the_admin_token(secure_channel: grpc.Channel, rpc: str) -> None:
    stub = rollout_pb2_grpc.RolloutStub(secure_channel)
    version = stub.Health(pb.HealthRequest(), metadata=bearer(DATA_TOKEN)).policy_version + 1

    def update(metadata) -> grpc.StatusCode:
        messages = weight_update(version)
        if rpc == "UpdateWeightsAtOnce":
            request = pb.UpdateWeightsAtOnceRequest(messages=messages)
            return call_code(stub.UpdateWeightsAtOnce, request, metadata=metadata)
        return call_code(stub.UpdateWeights, iter(messages), metadata=metadata)

    assert update(bearer(None)) == grpc.StatusCode.UNAUTHENTICATED
    assert update(bearer("wrong-token")) == grpc.StatusCode.UNAUTHENTICATED
    assert update(bearer(DATA_TOKEN)) == grpc.StatusCode.PERMISSION_DENIED
    # Refused calls changed nothing; the admin's update lands.
    health = stub.Health(pb.HealthRequest(), metadata=bearer(ADMIN_TOKEN))
    assert health.policy_version == version - 1
    assert update((("authorization", f"bearer {ADMIN_TOKEN}"),)) == grpc.StatusCode.OK
    health = stub.Health(pb.HealthRequest(), metadata=bearer(DATA_TOKEN))
    assert health.policy_version == version


def test_refusals_say_why_without_echoing_tokens(secure_channel: grpc.Channel) -> None:
    stub = rollout_pb2_grpc.RolloutStub(secure_channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.Health(pb.HealthRequest(), metadata=bearer("guess-1234"), timeout=WAIT_S)
    assert "invalid bearer token" in info.value.details()
    assert "guess-1234" not in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stub.UpdateWeights(iter(weight_update(10**6)), metadata=bearer(DATA_TOKEN), timeout=WAIT_S)
    assert "admin token" in info.value.details()


def test_the_rollout_client_speaks_tokens_and_mutual_tls(certs: Certs, secure_server) -> None:
    from rollserve.client.client import RolloutClient
    from rollserve.client.protocol.errors import PermissionDenied, Unauthenticated

    pem = {
        "root_certificates": certs.ca,
        "private_key": certs.client_key,
        "certificate_chain": certs.client_cert,
    }
    target = secure_server[1]
    with RolloutClient(target, timeout_s=WAIT_S, token=DATA_TOKEN, **pem) as client:
        version = client.health().policy_version
        experience = client.make_experience(
            [[5, 6, 7]], max_new_tokens=2, seed=1, rewards=["exact_match"], gt_answers=["x"]
        )
        assert experience.num_rows == 1
        weights = {"model.norm.weight": torch.ones(64)}
        with pytest.raises(PermissionDenied):
            client.update_weights(weights, version=version + 1, mode="partial")
    with RolloutClient(target, timeout_s=WAIT_S, token=ADMIN_TOKEN, **pem) as client:
        assert client.update_weights(weights, version=version + 1, mode="partial").version
        assert client.health().policy_version == version + 1
    with RolloutClient(target, timeout_s=WAIT_S, **pem) as client, pytest.raises(Unauthenticated):
        client.health()


def test_health_command_over_mutual_tls(certs: Certs, secure_server) -> None:
    files = certs.files
    command = [sys.executable, "-m", "rollserve.server", "health", "--target", secure_server[1]]
    tls = ["--tls-ca", str(files["ca.pem"])]
    client = ["--tls-cert", str(files["client.pem"]), "--tls-key", str(files["client.key"])]
    ok = subprocess.run(command + tls + client, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "SERVING" in ok.stdout
    refused = subprocess.run(command + tls, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "UNAVAILABLE" in refused.stdout


def test_server_log_names_the_transport_and_never_a_token(secure_server) -> None:
    proc, _ = secure_server
    log = proc.log_text()
    assert "mutual TLS, auth on" in log
    assert "status=UNAUTHENTICATED" in log and "status=PERMISSION_DENIED" in log
    assert DATA_TOKEN not in log and ADMIN_TOKEN not in log


# ---- in-process: TLS without client certificates, start-up errors -----------------------------


def _config(**overrides) -> ServerConfig:
    return ServerConfig(
        **{"host": "127.0.0.1", "port": 0, "device": "cpu", "metrics_port": 0, **overrides}
    )


def test_tls_server_accepts_any_client_that_trusts_it(certs: Certs) -> None:
    from rollserve.server.models import load_models
    from rollserve.server.serving.app import RolloutServer

    config = _config(
        tls_cert=str(certs.files["server.pem"]), tls_key=str(certs.files["server.key"])
    )
    with RolloutServer(config, models=load_models(config)) as server:
        target = f"127.0.0.1:{server.port}"
        with grpc.secure_channel(target, client_credentials(certs, client=None)) as channel:
            assert health_check(channel) == SERVING
            # No token configured: authentication is off.
            health = rollout_pb2_grpc.RolloutStub(channel).Health(pb.HealthRequest(), timeout=10)
            assert health.status == pb.SERVING_STATUS_SERVING
        with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as info:
            health_check(channel, timeout_s=5.0)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"tls_cert": "ca.pem", "tls_key": "missing.key"}, "tls_key: cannot read"),
        ({"tls_cert": "notes.txt", "tls_key": "server.key"}, "tls_cert: .* is not a PEM file"),
        ({"data_token_file": "missing-token"}, "data_token_file: cannot read"),
        ({"admin_token_file": "spaced-token"}, "printable ASCII without spaces"),
        ({"admin_token_file": "data-token", "data_token": "same-token"}, "must differ"),
    ],
)
def test_unusable_security_files_fail_before_binding(
    certs: Certs, tmp_path: Path, overrides: dict[str, str], match: str
) -> None:
    (tmp_path / "notes.txt").write_text("not a certificate")
    (tmp_path / "spaced-token").write_text("two words\n")
    (tmp_path / "data-token").write_text("same-token\n")
    for name, data in (("ca.pem", certs.ca), ("server.key", certs.server_key)):
        (tmp_path / name).write_bytes(data)
    config = _config(**{key: str(tmp_path / value) if key != "data_token" else value
                        for key, value in overrides.items()})  # fmt: skip
    with pytest.raises(SecurityConfigError, match=match):
        load_tokens(config)
        server_credentials(config)


def test_cli_reports_security_file_errors_and_exits_1(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "rollserve.server", "--port", "0", "--metrics-port", "0"]
    command += ["--host", "127.0.0.1", "--admin-token-file", str(tmp_path / "absent")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "admin_token_file: cannot read" in result.stderr
    assert "Traceback" not in result.stderr


# ---- pure functions ----------------------------------------------------------------------------

TOKENS = AuthTokens(data=DATA_TOKEN.encode(), admin=ADMIN_TOKEN.encode())
MAKE = "/rollserve.v1.Rollout/MakeExperience"
UPDATE = "/rollserve.v1.Rollout/UpdateWeights"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED


def test_roles_of_methods() -> None:
    assert required_role(MAKE) is Role.DATA
    assert required_role("/rollserve.v1.Rollout/Health") is Role.DATA
    assert required_role(UPDATE) is Role.ADMIN
    assert required_role("/rollserve.v1.Rollout/UpdateWeightsAtOnce") is Role.ADMIN
    assert required_role("/grpc.health.v1.Health/Check") is Role.OPEN
    assert required_role("/grpc.health.v1.Health/Watch") is Role.OPEN
    reflection = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    assert required_role(reflection) is Role.OPEN
    assert required_role("/some.Other/Method") is Role.DATA  # closed unless listed as open


def _auth(value: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", value),)


@pytest.mark.parametrize(
    ("tokens", "method", "metadata", "expected"),
    [
        (AuthTokens(), UPDATE, (), None),  # auth off
        (TOKENS, "/grpc.health.v1.Health/Check", (), None),
        (TOKENS, MAKE, (), UNAUTHENTICATED),
        (TOKENS, MAKE, _auth(DATA_TOKEN), UNAUTHENTICATED),  # no scheme
        (TOKENS, MAKE, _auth(f"Basic {DATA_TOKEN}"), UNAUTHENTICATED),
        (TOKENS, MAKE, (("x-token", f"Bearer {DATA_TOKEN}"),), UNAUTHENTICATED),
        (TOKENS, MAKE, _auth(f"Bearer {DATA_TOKEN}"), None),
        (TOKENS, MAKE, _auth(f"BEARER  {ADMIN_TOKEN} "), None),
        (TOKENS, UPDATE, _auth(f"Bearer {DATA_TOKEN}"), DENIED),
        (TOKENS, UPDATE, _auth(f"Bearer {ADMIN_TOKEN}"), None),
        (AuthTokens(data=b"d-token"), UPDATE, _auth("Bearer d-token"), DENIED),
        (AuthTokens(admin=b"a-token"), MAKE, _auth("Bearer a-token"), None),
        (AuthTokens(admin=b"a-token"), MAKE, _auth("Bearer d-token"), UNAUTHENTICATED),
    ],
)
def test_authorize(tokens: AuthTokens, method: str, metadata, expected) -> None:
    result = authorize(tokens, method, metadata)
    assert (None if result is None else result.code) == expected


def test_tokens_never_appear_in_reprs() -> None:
    assert DATA_TOKEN not in repr(TOKENS) and ADMIN_TOKEN not in repr(TOKENS)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("gpu-node", False)],
)  # fmt: skip
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_security_warnings() -> None:
    assert security_warnings(ServerConfig(host="127.0.0.1"), AuthTokens()) == []
    exposed = security_warnings(ServerConfig(host="0.0.0.0"), AuthTokens())
    assert len(exposed) == 2
    assert "authentication is off" in exposed[0] and "TLS is off" in exposed[1]
    clear_tokens = security_warnings(ServerConfig(host="0.0.0.0"), TOKENS)
    assert clear_tokens == [clear_tokens[0]] and "bearer tokens travel" in clear_tokens[0]
    tls = ServerConfig(host="0.0.0.0", tls_cert="/c.pem", tls_key="/k.pem")
    assert security_warnings(tls, TOKENS) == []
    data_only = security_warnings(ServerConfig(host="127.0.0.1"), AuthTokens(data=b"d-token"))
    assert data_only == ["no admin token: UpdateWeights is refused to every caller"]


def test_binding_a_public_host_without_auth_logs_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from rollserve.server.serving.app import RolloutServer

    # Bound but never loaded: nothing can be served, so exposing 0.0.0.0 briefly is harmless.
    server = RolloutServer(_config(host="0.0.0.0"))
    with caplog.at_level(logging.WARNING, logger="rollserve.server"):
        server.bind()
    try:
        messages = [record.getMessage() for record in caplog.records]
        assert any("authentication is off on non-loopback host 0.0.0.0" in m for m in messages)
    finally:
        server.stop(0)
