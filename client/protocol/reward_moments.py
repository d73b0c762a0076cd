"""LightRFT's running reward moments as the trainer threads them from request to request.

The server keeps no state between requests (any replica may serve the next one), so the
running moments of AlgorithmOptions.reward_running_norm travel with the trainer: they go out
in AlgorithmOptions.reward_moments and come back in every Experience's info, one copy per row
(REWARD_MOMENTS_INFO_KEYS), each row holding the moments after its micro-batch. Joined
micro-batches keep their order, so the last row is the state after the whole request.

    moments = RunningRewardMoments()  # no history yet
    for prompts in batches:
        experience = client.make_experience(
            prompts, preset="lightrft", algorithm={"reward_running_norm": "standardize"},
            reward_moments=moments,
        )
        moments = RunningRewardMoments.from_experience(experience)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...v1 import rollout_pb2 as pb
from .errors import InvalidArgument

if TYPE_CHECKING:
    from .experience import Experience

__all__ = ["REWARD_MOMENTS_INFO_KEYS", "RunningRewardMoments"]

# Experience.info keys of the moments after each row's micro-batch: (B,) float64 each.
REWARD_MOMENTS_INFO_KEYS = {
    "count": "reward_moments/count",
    "mean": "reward_moments/mean",
    "var": "reward_moments/var",
}


@dataclass(frozen=True)
class RunningRewardMoments:
    """count, mean and population variance of the rewards seen so far (LightRFT's
    RunningMoments); count 0 (the default) means no history."""

    count: float = 0.0
    mean: float = 0.0
    var: float = 0.0

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise InvalidArgument(f"reward_moments: {problem}")

    def problem(self) -> str | None:
        """Why these moments cannot be a running state, or None (rollout.proto: RewardMoments).

        The server asks the same of a request's moments (they may come from any client)."""
        values = {"count": self.count, "mean": self.mean, "var": self.var}
        for name, value in values.items():
            if not math.isfinite(value):
                return f"{name} must be finite, got {value!r}"
        if self.count < 0:
            return f"count must be >= 0, got {self.count!r}"
        if self.count == 0:
            if self.mean != 0 or self.var != 0:
                return "count 0 (no history) needs mean 0 and var 0"
            return None
        # LightRFT's moments never lose their spread (its prior's 1e-24 count has variance 1),
        # so a zero one cannot come from it, and it would divide by zero.
        if not self.count * self.var > 0:
            return f"count > 0 needs var > 0 (and count * var > 0), got var {self.var!r}"
        return None

    @property
    def is_empty(self) -> bool:
        return self.count == 0

    def to_proto(self) -> pb.RewardMoments:
        return pb.RewardMoments(count=self.count, mean=self.mean, var=self.var)

    @classmethod
    def from_proto(cls, message: pb.RewardMoments) -> RunningRewardMoments:
        """InvalidArgument when the message's values cannot be a running state."""
        return cls(count=message.count, mean=message.mean, var=message.var)

    @classmethod
    def from_info(cls, info: Mapping[str, torch.Tensor], row: int = -1) -> RunningRewardMoments:
        """The moments after the micro-batch of `row` (default: the last row) of an info dict;
        KeyError when the request had reward_running_norm off."""
        missing = [key for key in REWARD_MOMENTS_INFO_KEYS.values() if key not in info]
        if missing:
            raise KeyError(
                f"no running reward moments in this experience (missing {missing}): "
                "the request did not ask for AlgorithmOptions.reward_running_norm"
            )
        values = {name: float(info[key][row]) for name, key in REWARD_MOMENTS_INFO_KEYS.items()}
        return cls(**values)

    @classmethod
    def from_experience(cls, experience: Experience, row: int = -1) -> RunningRewardMoments:
        """The moments after the last micro-batch of an Experience (its info's last row): the
        state to send with the next request."""
        return cls.from_info(experience.info, row)
