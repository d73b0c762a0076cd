"""Turn a request's AlgorithmOptions into an AlgorithmConfig: preset values, then request values.

Every error names the request field ("algorithm.kl_mode: unknown 'foo'; expected one of ...")
so that the servicer can send the message as is with INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ...client.protocol.errors import FailedPrecondition, InvalidArgument
from ...v1 import rollout_pb2
from .advantages import WHITENINGS
from .groups import ESTIMATORS
from .kl import KL_ESTIMATORS
from .masking import ACTION_MASK_RULES
from .presets import PRESET_NAMES, AlgorithmConfig, preset_config
from .rewards import OVERLONG_LENGTHS, REWARD_PLACEMENTS
from .running_norm import RUNNING_NORMS

__all__ = ["KL_MODES", "resolve_algorithm"]

KL_MODES = ("reward", "loss", "sequence")

_MAX = 3.4028234663852886e38  # the largest finite float32: a proto float beyond it is inf

# Request float field -> (config field, lowest valid value, highest valid value). Infinity is
# valid only where it means "no limit" (a clamp, an epsilon); a coefficient that multiplies must
# be finite: kl_coef inf times a KL of 0 gave NaN advantages, overlong_factor inf -inf or NaN
# rewards.
_FLOAT_FIELDS: dict[str, tuple[str, float, float]] = {
    "gamma": ("gamma", 0.0, 1.0),
    "lam": ("lam", 0.0, 1.0),
    "kl_coef": ("kl_coef", 0.0, _MAX),
    "kl_clamp": ("kl_clamp", 0.0, math.inf),
    "reward_clip": ("reward_clip", 0.0, math.inf),
    "advantage_clip": ("advantage_clip", 0.0, math.inf),
    "group_std_eps": ("group_std_eps", 0.0, math.inf),
    "high_entropy_token_ratio": ("high_entropy_token_ratio", 0.0, 1.0),
    "overlong_factor": ("overlong_factor", 0.0, _MAX),
    "clip_filter_eps": ("clip_filter_eps", 0.0, math.inf),
}


def _choice(field: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        expected = ", ".join(repr(a) for a in allowed)
        raise InvalidArgument(f"algorithm.{field}: unknown {value!r}; expected one of {expected}")
    return value


def _bounded(field: str, value: float, low: float, high: float) -> float:
    # `not (low <= v <= high)` also rejects NaN.
    if not (low <= value <= high):
        bound = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise InvalidArgument(f"algorithm.{field}: must be {bound}, got {value!r}")
    return float(value)


def _request_values(options: rollout_pb2.AlgorithmOptions) -> dict[str, Any]:
    """The config fields the request sets explicitly (unset optional fields are left out)."""
    values: dict[str, Any] = {}
    for field, (target, low, high) in _FLOAT_FIELDS.items():
        if options.HasField(field):
            values[target] = _bounded(field, getattr(options, field), low, high)
    if options.kl_estimator:
        values["kl_estimator"] = _choice("kl_estimator", options.kl_estimator, KL_ESTIMATORS)
    if options.kl_mode:
        values["kl_mode"] = _choice("kl_mode", options.kl_mode, KL_MODES)
    if options.reward_placement:
        values["reward_placement"] = _choice(
            "reward_placement", options.reward_placement, REWARD_PLACEMENTS
        )
    if options.whitening:
        values["whitening"] = _choice("whitening", options.whitening, WHITENINGS)
        # Asked for by name, it applies whatever the estimator (the preset's scope is a default).
        values["whiten_estimators"] = frozenset(ESTIMATORS)
    if options.dynamic_sampling:
        values["dynamic_sampling"] = True
    if options.experience_norm:
        values["experience_norm"] = True
    if options.length_normalized_log_probs:
        values["length_normalized_log_probs"] = True
    if options.HasField("stop_properly_penalty"):
        coef = options.stop_properly_penalty
        values["stop_properly_penalty"] = _bounded("stop_properly_penalty", coef, -_MAX, _MAX)
    if options.overlong_length:
        values["overlong_length"] = _choice(
            "overlong_length", options.overlong_length, OVERLONG_LENGTHS
        )
    if options.action_mask_rule:
        values["action_mask_rule"] = _choice(
            "action_mask_rule", options.action_mask_rule, ACTION_MASK_RULES
        )
    if options.reward_running_norm:
        values["reward_running_norm"] = _choice(
            "reward_running_norm", options.reward_running_norm, RUNNING_NORMS
        )
    if options.HasField("overlong_buffer"):
        if options.overlong_buffer < 0:
            raise InvalidArgument(
                f"algorithm.overlong_buffer: must be >= 0, got {options.overlong_buffer}"
            )
        values["overlong_buffer"] = int(options.overlong_buffer)
    return values


def resolve_algorithm(
    options: rollout_pb2.AlgorithmOptions, *, default_preset: str, has_critic: bool
) -> AlgorithmConfig:
    """Resolve a request's options: unset fields take the preset's values.

    Raises InvalidArgument naming the field for an unknown name or an out-of-range value, and
    FailedPrecondition when the estimator needs a critic the server does not have. gamma is
    forced to 1 for the preset's gamma-forced estimators even when the request sets it, as the
    framework does (AlgorithmConfig.effective_gamma).
    """
    if default_preset not in PRESET_NAMES:
        raise ValueError(f"default preset {default_preset!r} is not one of {PRESET_NAMES}")
    preset = _choice("preset", options.preset, PRESET_NAMES) if options.preset else default_preset
    estimator = None
    if options.advantage_estimator:
        estimator = _choice("advantage_estimator", options.advantage_estimator, ESTIMATORS)
    config = preset_config(
        preset,
        estimator,
        has_critic=has_critic,
        reproduce_upstream_quirks=options.reproduce_upstream_quirks,
    )
    config = replace(config, **_request_values(options))
    if config.needs_critic and not has_critic:
        raise FailedPrecondition(
            "algorithm.advantage_estimator: 'gae' needs a critic and this server has none; "
            "load one with --critic or choose a critic-free estimator"
        )
    if config.overlong_factor > 0 and config.overlong_buffer == 0:
        raise InvalidArgument(
            "algorithm.overlong_buffer: must be >= 1 when overlong_factor is above 0"
        )
    return config
