"""Reward sources other than the reward model: rule functions, user functions, HTTP endpoints.

Every text source has one batched signature, so built-in rules, user functions and remote
endpoints are interchangeable in a reward recipe:

    fn(prompts: list[str], responses: list[str], gt_answers: list[str | None]) -> list[float]

`responses` are the decoded valid response tokens (special tokens skipped). User functions and
endpoints are registered when the server starts (`--reward-fn NAME=MODULE:FUNCTION`,
`--reward-endpoint NAME=URL`) and requests pick them by name: a request can never make the
server import a module or call an address of its choosing.

Remote endpoint protocol (HTTP POST, JSON both ways, UTF-8):
    request:  {"prompts": [str], "responses": [str], "gt_answers": [str | null]}
    response: {"rewards": [float]}   (one finite number per response, same order)
Transport failures and timeouts raise Unavailable (retryable); a reply that breaks the format
raises FailedPrecondition (the deployment is misconfigured; retrying will not help).
"""

from __future__ import annotations

import importlib
import json
import math
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ...client.protocol.errors import (
    FailedPrecondition,
    InvalidArgument,
    RolloutError,
    Unavailable,
)

RewardFn = Callable[[list[str], list[str], list["str | None"]], Sequence[float]]

REWARD_MODEL_SOURCE = "reward_model"
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _normalise(text: str) -> str:
    return " ".join(text.split())


def exact_match(
    prompts: list[str], responses: list[str], gt_answers: list[str | None]
) -> list[float]:
    """1.0 when the response equals the answer up to surrounding and repeated whitespace."""
    return [
        float(gt is not None and _normalise(r) == _normalise(gt))
        for r, gt in zip(responses, gt_answers, strict=True)
    ]


def last_number(text: str) -> float | None:
    """The last number in `text` ("1,234.5" reads as 1234.5), or None."""
    matches = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3})", "", text))
    return float(matches[-1]) if matches else None


def numeric_match(
    prompts: list[str], responses: list[str], gt_answers: list[str | None]
) -> list[float]:
    """1.0 when the last number in the response equals the answer's (relative tol 1e-6)."""
    scores = []
    for response, gt in zip(responses, gt_answers, strict=True):
        got, want = last_number(response), None if gt is None else last_number(gt)
        ok = got is not None and want is not None and math.isclose(got, want, rel_tol=1e-6)
        scores.append(float(ok))
    return scores


BUILTIN_RULES: Mapping[str, RewardFn] = {"exact_match": exact_match, "numeric_match": numeric_match}


def load_function(spec: str) -> RewardFn:
    """Import "package.module:function" (at server start, never per request)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"reward function must look like MODULE:FUNCTION, got {spec!r}")
    function = getattr(importlib.import_module(module_name), attribute)
    if not callable(function):
        raise ValueError(f"{spec} is not callable")
    return function


@dataclass(frozen=True)
class RemoteReward:
    """A reward endpoint speaking the JSON protocol of this module's docstring."""

    name: str
    url: str
    timeout_s: float = 30.0

    def __call__(
        self, prompts: list[str], responses: list[str], gt_answers: list[str | None]
    ) -> list[float]:
        body = json.dumps({"prompts": prompts, "responses": responses, "gt_answers": gt_answers})
        request = urllib.request.Request(
            self.url, data=body.encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                payload = reply.read()
        except (urllib.error.URLError, TimeoutError, OSError) as error:
            raise Unavailable(f"reward endpoint {self.name!r} failed: {error}") from error
        return self._parse(payload, len(responses))

    def _parse(self, payload: bytes, expected: int) -> list[float]:
        try:
            rewards = json.loads(payload)["rewards"]
            values = [float(r) for r in rewards]
        except (ValueError, KeyError, TypeError) as error:
            raise FailedPrecondition(
                f"reward endpoint {self.name!r} sent a malformed reply ({error!r}); expected "
                '{"rewards": [float, ...]}'
            ) from error
        if len(values) != expected or not all(math.isfinite(v) for v in values):
            raise FailedPrecondition(
                f"reward endpoint {self.name!r} sent {len(values)} rewards for {expected} "
                "responses, or a non-finite value"
            )
        return values


def _split_named(spec: str) -> tuple[str, str]:
    name, sep, target = spec.partition("=")
    if not sep or not name or not target:
        raise ValueError(f"expected NAME=VALUE, got {spec!r}")
    return name, target


@dataclass(frozen=True)
class RewardRegistry:
    """The text reward sources a server offers, by name."""

    sources: Mapping[str, RewardFn] = field(default_factory=lambda: dict(BUILTIN_RULES))

    @classmethod
    def from_specs(
        cls,
        functions: Sequence[str] = (),
        endpoints: Sequence[str] = (),
        *,
        timeout_s: float = 30.0,
    ) -> RewardRegistry:
        """Build from "NAME=MODULE:FUNCTION" and "NAME=URL" strings (server flags)."""
        sources: dict[str, RewardFn] = dict(BUILTIN_RULES)
        added: list[tuple[str, RewardFn]] = []
        for spec in functions:
            name, target = _split_named(spec)
            added.append((name, load_function(target)))
        for spec in endpoints:
            name, url = _split_named(spec)
            added.append((name, RemoteReward(name, url, timeout_s)))
        for name, function in added:
            if name in sources or name == REWARD_MODEL_SOURCE:
                raise ValueError(f"reward source {name!r} is defined twice or is reserved")
            sources[name] = function
        return cls(sources)

    def offered(self, *, has_reward_model: bool) -> list[str]:
        """The sources a request may name: the text sources, and reward_model with a model."""
        return sorted([*self.sources, *([REWARD_MODEL_SOURCE] if has_reward_model else [])])

    def check(self, source: str, *, has_reward_model: bool) -> None:
        """Raise if a request may not use `source` on this server."""
        if source == REWARD_MODEL_SOURCE:
            if not has_reward_model:
                raise FailedPrecondition(
                    "rewards: source 'reward_model' needs a reward model; start the server "
                    "with --reward-model DIR"
                )
            return
        if source not in self.sources:
            offered = self.offered(has_reward_model=has_reward_model)
            raise InvalidArgument(
                f"rewards: unknown source {source!r}; this server offers {offered}"
            )

    def score(
        self,
        source: str,
        prompts: list[str],
        responses: list[str],
        gt_answers: list[str | None],
    ) -> list[float]:
        """Raw rewards of one text source for a batch."""
        try:
            values = list(self.sources[source](prompts, responses, gt_answers))
        except RolloutError:
            raise
        except Exception as error:  # user code: name the source, keep its internals off the wire
            raise FailedPrecondition(
                f"reward source {source!r} raised {type(error).__name__}"
            ) from error
        if len(values) != len(responses):
            raise FailedPrecondition(
                f"reward source {source!r} returned {len(values)} values for "
                f"{len(responses)} responses"
            )
        return [float(v) for v in values]
