"""Hardening, fourth round: misuse of the client library and of the server's flags that crashed
with an unhelpful error, or silently did something else than asked.

One in-process server on 127.0.0.1:0 serves the tiny model, its waits set to the longest a flag
now takes (so every such wait is shown to work). Each case was a defect found by probing:

* Server flags of seconds took any finite value; past ~9.2e9 s (threading.TIMEOUT_MAX) Python's
  waits raise OverflowError: --drain-delay-s or --shutdown-grace-s crashed the shutdown with a
  traceback, --parallel-part-wait-s failed every parallel update, --reward-timeout-s every
  reward endpoint call, --stream-send-timeout-s killed the stream watchdog. And
  --reward-timeout-s 0 made every endpoint call fail at once (a non-blocking connect). Now a
  usage error naming the flag. `rollserve health --timeout-s inf` reported a serving server as
  DEADLINE_EXCEEDED; now a usage error.
* --port-file in a missing folder, or naming a directory: a traceback. Now one line naming it.
* A client timeout_s past ~7e9 s: every call failed DEADLINE_EXCEEDED at once, without reaching
  the server. Now ValueError. A target that is not a string failed with AttributeError on the
  first call, "" with UNKNOWN; max_message_bytes True was a one-byte limit, 2**40 OverflowError.
* make_experience("text") sent one prompt per character; [b"hi"] sent token ids 104, 105; float
  ids were truncated and digit strings parsed as ids. gt_answers="42" was sent as ["4", "2"],
  stop_strings="</a>" stopped at any of its characters. Now TypeError naming the argument.
* UpdateOptions took a float chunk_bytes (UNKNOWN "Exception iterating requests!"), a float or
  True for streams, and flags that were not bools ("false" is truthy). Now InvalidArgument.
* An error raised while an update's messages were made (the caller's progress callback, a meta
  tensor, a tensor resized while sent) reached the caller as UNKNOWN "Exception iterating
  requests!"; a progress that is not callable the same way. Now the error itself (TypeError for
  the progress, before anything is sent; InvalidArgument for the meta tensor).
* Cancelling AsyncRolloutClient.update_weights raised CancelledError while the upload went on in
  its thread, and the server applied the update. Now the upload stops at its next message.

After every refusal the actor's weights and version are unchanged.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_server import serve_in_process
from helpers_weights import weights_and_version
from rollserve.client import (
    AsyncRolloutClient,
    ExperienceOptions,
    InvalidArgument,
    RolloutClient,
    UpdateOptions,
    build_make_experience_request,
)
from rollserve.client.calls import MAX_TIMEOUT_S
from rollserve.server.config import ConfigError, ServerConfig, env_name, flag_name
from rollserve.server.config.flags import FLAGS
from rollserve.server.config.values import MAX_SECONDS, positive_seconds, seconds
from rollserve.server.models import ModelSet, load_models
from rollserve.server.serving.app import RolloutServer
from rollserve.server.serving.cli import main

CALL_S = 30.0  # bound on any call or wait; never reached when things work
SECONDS_FIELDS = [name for name, flag in FLAGS.items() if flag.parse in (seconds, positive_seconds)]


@pytest.fixture(scope="module")
def models(tiny_actor_dir: Path) -> ModelSet:
    return load_models(ServerConfig(device="cpu", actor=str(tiny_actor_dir)))


@pytest.fixture(scope="module")
def server(models: ModelSet) -> Iterator[RolloutServer]:
    # The longest waits the flags take: each must work (these are the ones a request meets).
    longest = {
        name: MAX_SECONDS
        for name in ("parallel_part_wait_s", "stream_send_timeout_s", "update_idle_timeout_s")
    }
    running = serve_in_process(models, **longest)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def client(server: RolloutServer) -> Iterator[RolloutClient]:
    with RolloutClient(server.address, timeout_s=CALL_S) as opened:
        yield opened


def _weights(models: ModelSet) -> dict[str, torch.Tensor]:
    return {k: t.detach().clone() for k, t in models.actor.module.state_dict().items()}


# ---- server flags ----------------------------------------------------------------------------


@pytest.mark.parametrize("field", SECONDS_FIELDS)
def test_a_wait_longer_than_python_can_wait_is_a_usage_error(
    field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", flag_name(field), "1e10"]) == 2
    assert f"argument {flag_name(field)}: must be a number in" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=f"environment variable {env_name(field)}"):
        ServerConfig.from_args([], {env_name(field): "1e10"})
    assert getattr(ServerConfig.from_args([flag_name(field), "1e8"], {}), field) == MAX_SECONDS


def test_a_reward_timeout_of_zero_is_a_usage_error() -> None:
    with pytest.raises(ConfigError, match="argument --reward-timeout-s: must be > 0"):
        ServerConfig.from_args(["--reward-timeout-s", "0"], {})


def test_the_health_probe_refuses_an_endless_deadline_and_takes_the_longest(
    server: RolloutServer, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["health", "--target", server.address, "--timeout-s", "inf"])
    assert exited.value.code == 2
    assert main(["health", "--target", server.address, "--timeout-s", f"{MAX_SECONDS:g}"]) == 0
    assert capsys.readouterr().out.strip().endswith("SERVING")


def test_a_port_file_that_cannot_be_written_is_one_line_naming_it(tmp_path: Path) -> None:
    port_file = tmp_path / "missing-folder" / "port"
    command = [
        sys.executable, "-m", "rollserve.server", "serve", "--host", "127.0.0.1", "--port", "0",
        "--metrics-port", "0", "--device", "cpu", "--port-file", str(port_file),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert f"error: port_file: cannot write {port_file}" in result.stderr
    assert "Traceback" not in result.stderr


# ---- client construction and deadlines -------------------------------------------------------


def test_a_deadline_past_what_grpc_represents_is_refused_and_the_longest_works(
    server: RolloutServer, client: RolloutClient
) -> None:
    with pytest.raises(ValueError, match="timeout_s must be in"):
        RolloutClient(server.address, timeout_s=1e10)
    with pytest.raises(ValueError, match="timeout_s must be in"):
        client.health(timeout_s=1e10)
    assert client.health(timeout_s=MAX_TIMEOUT_S).serving

    async def from_asyncio() -> bool:
        async with AsyncRolloutClient(server.address, timeout_s=MAX_TIMEOUT_S) as opened:
            return (await opened.health()).serving

    assert asyncio.run(from_asyncio())


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"target": None}, TypeError),
        ({"target": " "}, ValueError),
        ({"max_message_bytes": True}, TypeError),
        ({"max_message_bytes": 1.5e6}, TypeError),
        ({"max_message_bytes": 2**40}, ValueError),
    ],
)
def test_bad_targets_and_message_limits_are_refused_at_construction(
    options: dict, error: type[Exception]
) -> None:
    (name,) = options
    with pytest.raises(error, match=name):
        RolloutClient(**{"target": "127.0.0.1:1", **options})


# ---- MakeExperience requests -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompts", "fields", "match"),
    [
        ("What is 2+2?", {}, "prompts must be a list of prompts"),
        ([b"hi"], {}, r"prompts\[0\]: expected a sequence of integer token ids"),
        ([[1, 72.9]], {}, r"prompts\[0\]: expected a sequence of integer token ids"),
        ([["1", "72"]], {}, r"prompts\[0\]: expected a sequence of integer token ids"),
        (torch.tensor([[1.0, 72.0]]), {}, r"prompts\[0\]"),
        ([[1, 2]], {"stop_sequences": [[1.5]]}, r"stop_sequences\[0\]"),
        ([[1, 2], [3]], {"gt_answers": "42"}, "gt_answers must be a list of strings"),
        ([[1, 2]], {"stop_strings": "</a>"}, "stop_strings must be a list of strings"),
        ([[1, 2]], {"rewards": "exact_match"}, "rewards must be a list of source names"),
        ([[1, 2]], {"algorithm": ["kl_coef"]}, "algorithm must be a mapping"),
    ],
)
def test_prompts_and_options_that_would_be_split_or_truncated_are_refused(
    prompts: object, fields: dict, match: str
) -> None:
    with pytest.raises(TypeError, match=match):
        build_make_experience_request(prompts, **fields)  # type: ignore[arg-type]


def test_integer_prompts_of_numpy_and_torch_still_pass() -> None:
    for prompts in (np.array([[1, 72, 101]]), torch.tensor([[1, 72, 101]])):
        request = build_make_experience_request(prompts, stop_sequences=[np.array([5])])
        assert list(request.token_ids.values) == [1, 72, 101]
        assert list(request.sampling.stop_sequences[0].token_ids) == [5]
    assert ExperienceOptions(gt_answers=("a",), stop_strings=["\n\n"]).stop_strings == ["\n\n"]


# ---- UpdateWeights -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"chunk_bytes": 262144.0}, "chunk_bytes: an int"),
        ({"streams": 2.5}, "streams: an int"),
        ({"streams": True}, "streams: an int"),
        ({"crc32": "no"}, "crc32: True or False"),
        ({"allow_non_finite": "false"}, "allow_non_finite: True or False"),
    ],
)
def test_update_options_of_the_wrong_type_are_refused_when_made(fields: dict, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        UpdateOptions(**fields)


class _ProgressFailed(Exception):
    pass


def _fail(sent: int, total: int) -> None:
    if sent:
        raise _ProgressFailed(f"{sent} of {total}")


@pytest.mark.parametrize("streams", [1, 2])
def test_an_error_raised_while_sending_reaches_the_caller_as_itself(
    models: ModelSet, client: RolloutClient, streams: int
) -> None:
    before = weights_and_version(models.actor.module, client)
    weights = _weights(models)
    update = {"version": before[1] + 1, "transport": "grpc", "streams": streams}
    with pytest.raises(_ProgressFailed):
        client.update_weights(weights, progress=_fail, chunk_bytes=262144, **update)
    with pytest.raises(TypeError, match="progress must be callable"):
        client.update_weights(weights, progress=5, **update)  # type: ignore[arg-type]
    weights["model.norm.weight"] = torch.empty_like(weights["model.norm.weight"], device="meta")
    with pytest.raises(InvalidArgument, match="model.norm.weight: a meta tensor"):
        client.update_weights(weights, **update)
    assert weights_and_version(models.actor.module, client) == before


class _Gated(Mapping):
    """A state dict whose first tensor read by name (the upload's: the checks read items())
    waits until the test opens the gate."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self.reading = threading.Event()
        self.gate = threading.Event()

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def items(self):  # noqa: ANN201 - dict's items view
        return self._tensors.items()

    def values(self):  # noqa: ANN201 - dict's values view
        return self._tensors.values()

    def __getitem__(self, name: str) -> torch.Tensor:
        if not self.reading.is_set():
            self.reading.set()
            assert self.gate.wait(CALL_S)
        return self._tensors[name]


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_cancelling_an_async_update_stops_it_and_nothing_is_applied(
    models: ModelSet, server: RolloutServer, client: RolloutClient, transport: str
) -> None:
    before = weights_and_version(models.actor.module, client)
    weights = _Gated(_weights(models))
    # The loop's default executor runs the upload: shutting it down waits until the upload
    # thread ended. The test's own waits run in another.
    uploads, waits = ThreadPoolExecutor(max_workers=1), ThreadPoolExecutor(max_workers=1)

    async def cancel_while_sending() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(uploads)
        async with AsyncRolloutClient(server.address, timeout_s=CALL_S) as opened:
            task = asyncio.create_task(
                opened.update_weights(
                    weights, version=before[1] + 1, transport=transport, chunk_bytes=262144
                )
            )
            assert await loop.run_in_executor(waits, weights.reading.wait, CALL_S)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            weights.gate.set()
            await loop.run_in_executor(waits, uploads.shutdown)
        waits.shutdown()

    asyncio.run(cancel_while_sending())
    assert weights_and_version(models.actor.module, client) == before


@pytest.mark.parametrize(
    ("field", "value"),
    [("seed", -1), ("top_k", 10**12), ("max_new_tokens", 2**40), ("micro_batch_size", 2**40)],
)
def test_a_value_protobuf_cannot_hold_names_its_field(field: str, value: int) -> None:
    from rollserve.client.protocol.requests import build_make_experience_request

    with pytest.raises(ValueError, match=rf"^{field}: "):
        build_make_experience_request([[1, 2]], **{field: value})


@pytest.mark.parametrize("metadata", [{"x-a": "1"}, ["ab"], "ab", [("x-a", "1", "2")]])
def test_metadata_that_is_not_pairs_is_refused_at_construction(metadata: object) -> None:
    with pytest.raises(TypeError, match="metadata must be a sequence of"):
        RolloutClient("127.0.0.1:1", metadata=metadata)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [float("nan"), -1.0, 0.0])
def test_wait_until_ready_refuses_a_timeout_it_cannot_wait(bad: float) -> None:
    with RolloutClient("127.0.0.1:1") as client, pytest.raises(ValueError, match="timeout_s"):
        client.wait_until_ready(bad)
    with RolloutClient("127.0.0.1:1") as client, pytest.raises(ValueError, match="poll_s"):
        client.wait_until_ready(1.0, poll_s=bad)

    async def wait_async(timeout_s: float, poll_s: float) -> None:
        async with AsyncRolloutClient("127.0.0.1:1") as client:
            await client.wait_until_ready(timeout_s, poll_s=poll_s)

    with pytest.raises(ValueError, match="timeout_s"):
        asyncio.run(wait_async(bad, 0.2))
    with pytest.raises(ValueError, match="poll_s"):
        asyncio.run(wait_async(1.0, bad))


def test_a_device_torch_does_not_know_is_refused_before_the_call() -> None:
    """Against an address nobody listens on: a ValueError naming the device, not UNAVAILABLE
    (the device was parsed only after the server had made the whole request)."""
    with RolloutClient("127.0.0.1:1", timeout_s=5.0) as client:
        with pytest.raises(ValueError, match="device: 'nope'"):
            client.make_experience([[1, 2]], device="nope")
        with pytest.raises(ValueError, match="device: 'cuda:x'"):
            next(client.stream_experience([[1, 2]], device="cuda:x"))
        with pytest.raises(ValueError, match="device: 'nope'"):
            next(client.subscribe(device="nope"))


def test_client_and_server_bound_waits_and_messages_alike() -> None:
    """The same bounds written on both sides (the server's config imports neither torch nor the
    client package): they must not drift apart."""
    from rollserve.client.channel import MAX_MESSAGE_BYTES
    from rollserve.server.config.values import MAX_GRPC_MESSAGE_BYTES

    assert MAX_SECONDS == MAX_TIMEOUT_S
    assert MAX_GRPC_MESSAGE_BYTES == MAX_MESSAGE_BYTES
