"""RolloutClient transport behaviour: metadata and auth, TLS, deadlines, retries, typed errors.

Two kinds of server. A scripted stand-in (`ScriptedRollout`, a real grpc server on 127.0.0.1:0
implementing the generated servicer) records every call's metadata and answers from a script:
that is how a test sees what arrived on the wire, counts retry attempts and holds a call open.
The real RolloutServer (in-process, tiny Llama) checks a server that starts late and real
errors. tests/test_aio_client.py and tests/test_replicas.py import the stand-in from here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
import torch
from helpers_server import free_port
from rollserve.client import (
    AsyncRolloutClient,
    ExperienceOptions,
    LoraAdapter,
    ReplicatedRolloutClient,
    RolloutProgress,
    UpdateOptions,
    build_make_experience_request,
)
from rollserve.client.channel import RETRIED_METHODS, SERVICE_CONFIG, SERVICE_NAME, channel_options
from rollserve.client.client import RolloutClient
from rollserve.client.protocol.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from rollserve.client.protocol.experience import Experience, experience_to_proto
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

WAIT_S = 30.0  # bound on any wait for another thread; never reached when things work
TOKEN = "s3cret-token"
SCRIPTED_VERSION = 7
HANG = "hang"  # script step: hold the call open until the client cancels it
ONE_THEN_HANG = "one-then-hang"  # MakeExperience: send one micro-batch, then hang


# ---- the scripted stand-in server -------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    method: str
    metadata: dict[str, str | bytes]
    request_id: str = ""  # MakeExperienceRequest.request_id
    request: object = None  # the MakeExperienceRequest, or the UpdateWeights header


def _canned_response() -> pb.MakeExperienceResponse:
    """One valid 1-row micro-batch stamped with SCRIPTED_VERSION."""
    experience = Experience(
        sequences=torch.tensor([[1, 5, 6]]),
        attention_mask=torch.ones(1, 3, dtype=torch.bool),
        action_mask=torch.ones(1, 1, dtype=torch.bool),
        action_log_probs=torch.zeros(1, 1),
        reward=torch.ones(1),
        kl=torch.zeros(1, 1),
        advantages=torch.zeros(1, 1),
        returns=torch.zeros(1, 1),
        policy_version=torch.tensor([SCRIPTED_VERSION]),
        prompt_index=torch.tensor([0]),
    )
    return pb.MakeExperienceResponse(
        experience=experience_to_proto(experience), micro_batch_index=0, num_micro_batches=2
    )


class ScriptedRollout(rollout_pb2_grpc.RolloutServicer):
    """Records every call; per method, answers the next scripted step (a status code to abort
    with, HANG or ONE_THEN_HANG), or succeeds once the script is used up."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: list[Call] = []
        self.script: dict[str, list[object]] = {}
        self.cancelled = threading.Event()

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.script.clear()
        self.cancelled.clear()

    def methods(self) -> list[str]:
        with self._lock:
            return [call.method for call in self.calls]

    def _enter(self, method: str, context: grpc.ServicerContext, request: object = None) -> object:
        metadata = dict(context.invocation_metadata())
        request_id = getattr(request, "request_id", "")
        with self._lock:
            self.calls.append(Call(method, metadata, request_id, request))
            steps = self.script.get(method, [])
            step = steps.pop(0) if steps else None
        if isinstance(step, grpc.StatusCode):
            context.abort(step, f"scripted {step.name}")
        if step == HANG:
            self._hang(context)
        return step

    def _hang(self, context: grpc.ServicerContext) -> None:
        gone = threading.Event()  # this call's own, so one cancellation frees one hang
        # add_callback answers False when the call already ended (the client cancelled before
        # this handler resumed): the callback will never run, so count the cancellation here.
        if not (context.add_callback(gone.set) and context.add_callback(self.cancelled.set)):
            gone.set()
            self.cancelled.set()
        gone.wait(WAIT_S)
        context.abort(grpc.StatusCode.ABORTED, "the client never cancelled")

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        self._enter("Health", context)
        return pb.HealthResponse(status=pb.SERVING_STATUS_SERVING, policy_version=SCRIPTED_VERSION)

    def MakeExperience(
        self, request: pb.MakeExperienceRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.MakeExperienceResponse]:
        step = self._enter("MakeExperience", context, request)
        if step == ONE_THEN_HANG:
            # Registered before the first reply: once the client cancels, grpc may never
            # resume this generator, so a callback added after the yield could be missed.
            gone = threading.Event()
            context.add_callback(gone.set)
            context.add_callback(self.cancelled.set)
            yield _canned_response()
            gone.wait(WAIT_S)
            context.abort(grpc.StatusCode.ABORTED, "the client never cancelled")
        yield _canned_response()
        yield _canned_response()

    def UpdateWeights(
        self, request_iterator: Iterator[pb.UpdateWeightsRequest], context: grpc.ServicerContext
    ) -> pb.UpdateWeightsResponse:
        header = next(request_iterator).header  # recorded only once the header arrived
        self._enter("UpdateWeights", context, header)
        received = sum(len(r.chunk.data) for r in request_iterator)
        return pb.UpdateWeightsResponse(
            target=header.target,
            version=header.version,
            tensors=len(header.manifest),
            bytes=received,
        )


def _start(servicer: ScriptedRollout, credentials: grpc.ServerCredentials | None) -> grpc.Server:
    server = grpc.server(ThreadPoolExecutor(8))
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)
    if credentials is None:
        server.port = server.add_insecure_port("127.0.0.1:0")  # type: ignore[attr-defined]
    else:
        server.port = server.add_secure_port("127.0.0.1:0", credentials)  # type: ignore[attr-defined]
    server.start()
    return server


@pytest.fixture(scope="module")
def scripted_server() -> Iterator[tuple[ScriptedRollout, str]]:
    servicer = ScriptedRollout()
    server = _start(servicer, None)
    yield servicer, f"127.0.0.1:{server.port}"  # type: ignore[attr-defined]
    server.stop(0)


@pytest.fixture
def scripted(scripted_server: tuple[ScriptedRollout, str]) -> tuple[ScriptedRollout, str]:
    servicer, target = scripted_server
    servicer.reset()
    return servicer, target


# ---- a throwaway PKI for TLS (CA, server for "localhost" only, client) -------------------------


@dataclass(frozen=True)
class Pki:
    ca: bytes
    server_key: bytes
    server_chain: bytes
    client_key: bytes
    client_chain: bytes


def make_pki() -> Pki:
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(cn, key, issuer, issuer_key, *, ca=False, dns=()):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if dns:
            names = [x509.DNSName(name) for name in dns]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def pem_key(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def pem(cert) -> bytes:
        return cert.public_bytes(serialization.Encoding.PEM)

    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rollserve test CA")])
    ca = issue("rollserve test CA", ca_key, ca_name, ca_key, ca=True)
    server = issue("localhost", server_key, ca_name, ca_key, dns=("localhost",))
    client = issue("trainer", client_key, ca_name, ca_key)
    return Pki(pem(ca), pem_key(server_key), pem(server), pem_key(client_key), pem(client))


@pytest.fixture(scope="module")
def pki() -> Pki:
    return make_pki()


@pytest.fixture(scope="module")
def tls_server(pki: Pki) -> Iterator[tuple[ScriptedRollout, int]]:
    """The stand-in behind mutual TLS; its certificate names "localhost" (no IP address)."""
    credentials = grpc.ssl_server_credentials(
        [(pki.server_key, pki.server_chain)], root_certificates=pki.ca, require_client_auth=True
    )
    servicer = ScriptedRollout()
    server = _start(servicer, credentials)
    yield servicer, server.port  # type: ignore[attr-defined]
    server.stop(0)


# ---- metadata, auth, deadlines ----------------------------------------------------------------


def test_token_metadata_and_request_ids_arrive_on_every_call(scripted) -> None:
    servicer, target = scripted
    with RolloutClient(target, token=TOKEN, metadata=[("x-team", "rl")]) as client:
        assert client.health().policy_version == SCRIPTED_VERSION
        experience = client.make_experience([[5, 6]], request_id="exp-1")
        result = client.update_weights(
            {"w": torch.ones(4)}, version=3, mode="partial", request_id="upd-1"
        )
    assert experience.num_rows == 2 and experience.policy_version.tolist() == [7, 7]
    assert (result.version, result.tensors, result.target) == (3, 1, "ACTOR")
    # transport "auto" asks Health once whether the server shares this host (shared memory).
    health, make, probe, update = servicer.calls
    methods = ["Health", "MakeExperience", "Health", "UpdateWeights"]
    assert [c.method for c in servicer.calls] == methods
    for call in servicer.calls:
        assert call.metadata["authorization"] == f"Bearer {TOKEN}"
        assert call.metadata["x-team"] == "rl"
    assert "x-request-id" not in health.metadata and "x-request-id" not in probe.metadata
    assert make.metadata["x-request-id"] == "exp-1" and make.request_id == "exp-1"
    assert update.metadata["x-request-id"] == "upd-1"


# ---- request options: one dataclass each, shared by every client ------------------------------


def test_experience_options_are_one_dataclass_or_its_keywords_for_every_client(scripted) -> None:
    servicer, target = scripted
    options = ExperienceOptions(
        samples_per_prompt=2, rewards={"exact_match": 0.5}, algorithm={"kl_coef": 0.0}
    )
    keywords = dict(samples_per_prompt=2, rewards={"exact_match": 0.5}, algorithm={"kl_coef": 0.0})
    expected = build_make_experience_request([[5, 6]], options, seed=9, request_id="opts")

    async def from_asyncio() -> None:
        async with AsyncRolloutClient(target, timeout_s=WAIT_S) as client:
            await client.make_experience([[5, 6]], options, seed=9, request_id="opts")

    with RolloutClient(target, timeout_s=WAIT_S) as client:
        client.make_experience([[5, 6]], options, seed=9, request_id="opts")
        client.make_experience([[5, 6]], **keywords, seed=9, request_id="opts")
        list(client.stream_experience([[5, 6]], options, seed=9, request_id="opts"))
        with pytest.raises(TypeError, match="sample_per_prompt"):
            client.make_experience([[5]], sample_per_prompt=2)  # a misspelt option
    asyncio.run(from_asyncio())
    with ReplicatedRolloutClient([target], timeout_s=WAIT_S) as replicated:
        replicated.make_experience([[5, 6]], options, seed=9, request_id="opts")
        list(replicated.stream_experience([[5, 6]], **keywords, seed=9, request_id="opts"))
    sent = [call for call in servicer.calls if call.method == "MakeExperience"]
    assert [call.request for call in sent] == [expected] * 6
    assert all(call.metadata["x-request-id"] == "opts" for call in sent)
    assert options.seed is None  # keywords replace fields in a copy; the dataclass is frozen


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"chunk_bytes": 1}, "chunk_bytes"),
        ({"transport": "carrier-pigeon"}, "transport: one of auto, grpc, shm, dist"),
        ({"streams": 0}, "streams"),
        ({"mode": "lora"}, "lora must be given"),
        ({"lora": LoraAdapter(rank=2, alpha=4.0)}, "lora must be given"),
        ({"mode": "sideways"}, "mode"),
        ({"target": "policy"}, "target: unknown name 'policy'"),
        ({"target": 42}, "target"),
        ({"pack": True, "transport": "grpc"}, "pack: for transport 'cuda_ipc'"),
        ({"pack": True, "transport": "shm"}, "pack: for transport 'cuda_ipc'"),
    ],
)
def test_bad_update_options_are_refused_when_made(fields: dict, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        UpdateOptions(**fields)


def test_update_options_are_one_dataclass_or_its_keywords_for_every_client(scripted) -> None:
    servicer, target = scripted
    weights = {"w": torch.ones(4)}
    options = UpdateOptions(target="critic", mode="partial", transport="grpc", streams=1)

    async def from_asyncio() -> None:
        async with AsyncRolloutClient(target, timeout_s=WAIT_S) as client:
            await client.update_weights(weights, version=2, options=options, request_id="u-2")

    with RolloutClient(target, timeout_s=WAIT_S) as client:
        first = client.update_weights(weights, version=1, options=options, request_id="u-1")
        with pytest.raises(TypeError, match="strems"):
            client.update_weights(weights, version=1, strems=2)  # a misspelt option
    asyncio.run(from_asyncio())
    with ReplicatedRolloutClient([target], timeout_s=WAIT_S) as replicated:
        replicated.update_weights(
            weights, version=3, target="critic", mode="partial", transport="grpc", streams=1
        )
    sent = [call for call in servicer.calls if call.method == "UpdateWeights"]
    assert [(c.request.target, c.request.version) for c in sent] == [
        (pb.MODEL_ROLE_CRITIC, version) for version in (1, 2, 3)
    ]
    assert {c.request.mode for c in sent} == {pb.UPDATE_MODE_PARTIAL}
    assert [c.metadata.get("x-request-id") for c in sent] == ["u-1", "u-2", None]
    assert (first.target, first.version, first.transport) == ("CRITIC", 1, "grpc")


def test_no_token_sends_no_authorization(scripted) -> None:
    servicer, target = scripted
    with RolloutClient(target) as client:
        client.health()
    assert "authorization" not in servicer.calls[0].metadata


def test_per_call_deadline_overrides_the_client_default(scripted) -> None:
    servicer, target = scripted
    servicer.script["MakeExperience"] = [HANG]
    servicer.script["Health"] = [HANG]
    with RolloutClient(target, timeout_s=WAIT_S) as client:
        with pytest.raises(DeadlineExceeded) as info:
            client.make_experience([[5]], timeout_s=0.2)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with RolloutClient(target, timeout_s=0.2) as client:
        with pytest.raises(DeadlineExceeded):
            client.health()  # the client default applies when no override is given


def test_closing_a_stream_early_cancels_the_call(scripted) -> None:
    servicer, target = scripted
    servicer.script["MakeExperience"] = [ONE_THEN_HANG]
    with RolloutClient(target, timeout_s=WAIT_S) as client:
        stream = client.stream_experience([[5]])
        first = next(stream)
        assert first.num_rows == 1
        stream.close()
        # The server learns of the cancellation (its callback fires) well before the deadline.
        assert servicer.cancelled.wait(WAIT_S)


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPrecondition),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
    ],
)
def test_statuses_become_typed_errors_with_code_and_details(scripted, code, error) -> None:
    servicer, target = scripted
    servicer.script["MakeExperience"] = [code]
    with RolloutClient(target) as client, pytest.raises(error) as info:
        client.make_experience([[5]])
    assert info.value.code == code
    assert info.value.details == f"scripted {code.name}"


@pytest.mark.parametrize(
    "options",
    [
        {"timeout_s": 0},
        {"timeout_s": -1.0},
        {"timeout_s": float("inf")},
        {"token": ""},
        {"token": "two words"},
        {"token": "t", "metadata": [("authorization", "Basic x")]},
        {"metadata": [("X-Upper", "v")]},
        {"metadata": [("grpc-timeout", "1S")]},
        {"metadata": [("x-line", "a\nb")]},
        {"private_key": b"key"},
        {"credentials": grpc.ssl_channel_credentials(), "root_certificates": b"ca"},
        {"max_message_bytes": 0},
    ],
)
def test_bad_client_options_are_refused_at_construction(options) -> None:
    with pytest.raises(ValueError):
        RolloutClient("127.0.0.1:1", **options)


def test_bad_per_call_deadline_is_refused(scripted) -> None:
    _, target = scripted
    with RolloutClient(target) as client, pytest.raises(ValueError):
        client.health(timeout_s=0)


# ---- retries ----------------------------------------------------------------------------------


def test_service_config_retries_only_idempotent_methods() -> None:
    (method_config,) = SERVICE_CONFIG["methodConfig"]
    names = {(n["service"], n["method"]) for n in method_config["name"]}
    assert names == set(RETRIED_METHODS)
    assert (SERVICE_NAME, "UpdateWeights") not in names
    assert method_config["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    options = dict(channel_options())
    assert json.loads(options["grpc.service_config"]) == SERVICE_CONFIG
    assert options["grpc.enable_retries"] == 1 and options["grpc.keepalive_time_ms"] > 0


def test_unavailable_is_retried_for_health_and_make_experience(scripted) -> None:
    servicer, target = scripted
    unavailable = grpc.StatusCode.UNAVAILABLE
    servicer.script["Health"] = [unavailable, unavailable]
    servicer.script["MakeExperience"] = [unavailable, unavailable]
    with RolloutClient(target, timeout_s=WAIT_S) as client:
        assert client.health().serving
        assert client.make_experience([[5]]).num_rows == 2
    assert servicer.methods() == ["Health"] * 3 + ["MakeExperience"] * 3


def test_retries_are_bounded_and_other_codes_are_not_retried(scripted) -> None:
    servicer, target = scripted
    servicer.script["Health"] = [grpc.StatusCode.UNAVAILABLE] * 10
    servicer.script["MakeExperience"] = [grpc.StatusCode.INVALID_ARGUMENT]
    with RolloutClient(target, timeout_s=WAIT_S) as client:
        with pytest.raises(Unavailable):
            client.health()
        with pytest.raises(InvalidArgument):
            client.make_experience([[5]])
    assert servicer.methods() == ["Health"] * 4 + ["MakeExperience"]  # maxAttempts is 4


def test_update_weights_is_never_retried(scripted) -> None:
    servicer, target = scripted
    servicer.script["UpdateWeights"] = [grpc.StatusCode.UNAVAILABLE]
    with RolloutClient(target, timeout_s=WAIT_S) as client, pytest.raises(Unavailable):
        client.update_weights({"w": torch.ones(4)}, version=1, mode="partial", transport="grpc")
    assert servicer.methods() == ["UpdateWeights"]  # one header arrived, no replay


def test_nothing_listening_is_unavailable() -> None:
    with RolloutClient(f"127.0.0.1:{free_port()}", timeout_s=WAIT_S) as client:
        with pytest.raises(Unavailable):
            client.health()


# ---- TLS --------------------------------------------------------------------------------------


def test_mutual_tls_from_pem_bytes_or_channel_credentials(tls_server, pki: Pki) -> None:
    servicer, port = tls_server
    servicer.reset()
    pem = dict(
        root_certificates=pki.ca, private_key=pki.client_key, certificate_chain=pki.client_chain
    )
    with RolloutClient(f"localhost:{port}", token=TOKEN, **pem) as client:
        assert client.health().policy_version == SCRIPTED_VERSION
    credentials = grpc.ssl_channel_credentials(pki.ca, pki.client_key, pki.client_chain)
    with RolloutClient(f"localhost:{port}", credentials=credentials) as client:
        assert client.make_experience([[5]]).num_rows == 2
    assert servicer.calls[0].metadata["authorization"] == f"Bearer {TOKEN}"


@pytest.mark.parametrize("kind", ["plaintext", "no client certificate", "name mismatch"])
def test_tls_failures_are_unavailable(tls_server, pki: Pki, kind: str) -> None:
    _, port = tls_server
    target, options = f"localhost:{port}", {}
    if kind == "no client certificate":
        options = {"root_certificates": pki.ca}
    elif kind == "name mismatch":  # the certificate names localhost, not the IP address
        target = f"127.0.0.1:{port}"
        options = dict(
            root_certificates=pki.ca,
            private_key=pki.client_key,
            certificate_chain=pki.client_chain,
        )
    with RolloutClient(target, timeout_s=10, **options) as client, pytest.raises(Unavailable):
        client.health()


# ---- a real server that starts late -----------------------------------------------------------


def test_wait_until_ready_rides_out_a_server_that_starts_late(tiny_actor_dir) -> None:
    from rollserve.server.config import ServerConfig
    from rollserve.server.models import load_models
    from rollserve.server.serving.app import RolloutServer

    models = load_models(ServerConfig(device="cpu", actor=str(tiny_actor_dir)))
    port = free_port()
    config = ServerConfig(host="127.0.0.1", port=port, device="cpu", log_level="WARNING")
    server = RolloutServer(config, models=models)
    released = threading.Event()

    def start_late() -> None:
        # Not listening, then listening but LOADING, then SERVING.
        released.wait(WAIT_S)
        server.bind()
        server.load()

    starter = threading.Thread(target=start_late)
    starter.start()
    try:
        with RolloutClient(f"127.0.0.1:{port}", timeout_s=WAIT_S, token=TOKEN) as client:
            with pytest.raises(Unavailable):
                client.health()  # nothing listens yet: retried, then a typed error
            released.set()
            ready = client.wait_until_ready(timeout_s=60)
            assert ready.serving and ready.rollout is None  # no --rollout-prompts
            assert ready.weight_transports == ("grpc", "shm", "dist")
            experience = client.make_experience(
                [[5, 6, 7]], max_new_tokens=4, seed=1, rewards=["exact_match"], gt_answers=["x"]
            )
            assert experience.num_rows == 1 and experience.policy_version.tolist() == [0]
            with pytest.raises(InvalidArgument) as info:
                client.make_experience([[5]], samples_per_prompt=0)
            assert "samples_per_prompt" in info.value.details
    finally:
        released.set()
        starter.join(WAIT_S)
        server.stop(0)


def test_health_carries_the_continuous_rollouts_progress(tiny_actor_dir, tmp_path) -> None:
    from rollserve.server.config import ServerConfig
    from rollserve.server.serving.app import RolloutServer

    prompts = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"q{i}=", "gt_answer": "x"}) for i in range(4)]
    prompts.write_text("\n".join(lines) + "\n")
    template = tmp_path / "request.json"
    request = {"samplesPerPrompt": 2, "sampling": {"maxNewTokens": 4}}
    template.write_text(json.dumps({**request, "rewards": [{"source": "exact_match"}]}))
    config = ServerConfig(
        host="127.0.0.1", port=0, device="cpu", log_level="WARNING", metrics_port=0,
        actor=str(tiny_actor_dir), rollout_prompts=str(prompts), rollout_request=str(template),
        rollout_prompts_per_batch=2,
    )  # fmt: skip
    with RolloutServer(config) as server, RolloutClient(server.address, timeout_s=WAIT_S) as client:
        batches = list(client.subscribe("trainer"))  # the whole rollout: one epoch, 2 batches
        health = client.health()
        with grpc.insecure_channel(server.address) as channel:
            sent = rollout_pb2_grpc.RolloutStub(channel).Health(pb.HealthRequest(), timeout=WAIT_S)
    assert len(batches) == 2
    assert health.rollout == RolloutProgress(
        finished=True,
        epoch=0,
        step=2,
        batches_delivered=2,
        batches_dropped_stale=0,
        queued_batches=0,
        subscribers=0,
    )
    # Every field the RPC sends, as sent.
    assert sent.rollout.enabled
    assert dataclasses.asdict(health.rollout) == {
        name: getattr(sent.rollout, name) for name in dataclasses.asdict(health.rollout)
    }
