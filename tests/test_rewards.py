"""Text reward sources: built-in rules, user functions and a real HTTP reward endpoint."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rollserve.client.protocol.errors import FailedPrecondition, InvalidArgument, Unavailable
from rollserve.server.experience.rewards import (
    RewardRegistry,
    exact_match,
    last_number,
    numeric_match,
)


def length_reward(prompts: list[str], responses: list[str], gt: list[str | None]) -> list[float]:
    """A user reward function, imported by the registry as tests.test_rewards:length_reward."""
    return [float(len(r)) for r in responses]


def test_exact_match_ignores_whitespace_only() -> None:
    got = exact_match(["p"] * 4, ["42", " 42\n", "4 2", "42"], ["42", "42", "42", None])
    assert got == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("the answer is 12", 12.0),
        ("3 + 4 = 7.", 7.0),
        ("-1.5e3", -1500.0),
        ("1,234", 1234.0),
        ("none", None),
    ],
)
def test_last_number(text: str, number: float | None) -> None:
    assert last_number(text) == number


def test_numeric_match() -> None:
    got = numeric_match(["p"] * 4, ["so 7", "7.0000000001", "8", "seven"], ["7", "7", "7", "7"])
    assert got == [1.0, 1.0, 0.0, 0.0]


def test_registry_loads_user_function_and_checks_names() -> None:
    registry = RewardRegistry.from_specs(["length=tests.test_rewards:length_reward"])
    assert registry.score("length", ["p", "q"], ["ab", "abcd"], [None, None]) == [2.0, 4.0]
    registry.check("length", has_reward_model=False)
    with pytest.raises(InvalidArgument, match="unknown source 'nope'"):
        registry.check("nope", has_reward_model=False)
    with pytest.raises(FailedPrecondition, match="--reward-model"):
        registry.check("reward_model", has_reward_model=False)
    # The refusal lists only what this server can score: reward_model only with a model loaded.
    with pytest.raises(InvalidArgument) as without_model:
        registry.check("nope", has_reward_model=False)
    assert "reward_model" not in without_model.value.message
    assert "'length'" in without_model.value.message
    with pytest.raises(InvalidArgument, match="'reward_model'"):
        registry.check("nope", has_reward_model=True)
    with pytest.raises(ValueError, match="reserved"):
        RewardRegistry.from_specs(["exact_match=tests.test_rewards:length_reward"])
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        RewardRegistry.from_specs(["x=tests.test_rewards"])


class _Handler(BaseHTTPRequestHandler):
    mode = "ok"

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.mode == "ok":
            reply = {
                "rewards": [
                    len(r) + (gt == "x")
                    for r, gt in zip(body["responses"], body["gt_answers"], strict=True)
                ]
            }
        else:
            reply = {"scores": []}
        payload = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()
    server.server_close()


def test_remote_endpoint_round_trip(endpoint: str) -> None:
    registry = RewardRegistry.from_specs(endpoints=[f"remote={endpoint}"], timeout_s=5)
    assert registry.score("remote", ["p", "q"], ["abc", "d"], ["x", None]) == [4.0, 1.0]


def test_remote_endpoint_malformed_reply(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_Handler, "mode", "bad")
    registry = RewardRegistry.from_specs(endpoints=[f"remote={endpoint}"], timeout_s=5)
    with pytest.raises(FailedPrecondition, match="malformed"):
        registry.score("remote", ["p"], ["abc"], [None])


def test_remote_endpoint_down_is_unavailable() -> None:
    import socket

    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    registry = RewardRegistry.from_specs(
        endpoints=[f"remote=http://127.0.0.1:{port}/"], timeout_s=2
    )
    with pytest.raises(Unavailable, match="'remote'"):
        registry.score("remote", ["p"], ["abc"], [None])


def test_user_function_failure_names_the_source() -> None:
    registry = RewardRegistry({"boom": lambda p, r, g: 1 / 0})
    with pytest.raises(FailedPrecondition, match="'boom' raised ZeroDivisionError"):
        registry.score("boom", ["p"], ["r"], [None])
