"""RL math on experience tensors: KL estimators, reward shaping, advantages, presets.

Plain torch functions with shapes in comments and no hidden state; `shape_experience` chains
them for one request under an `AlgorithmConfig` built by `resolve_algorithm`. The presets and
the default preset are documented in presets.py (the one place).
"""

from __future__ import annotations

from .advantages import (
    WHITENINGS,
    clip_advantages,
    clip_fraction,
    cumulative_returns,
    gae,
    whiten,
)
from .filters import (
    clip_filter_weights,
    dynamic_sampling_mask,
    high_entropy_mask,
)
from .groups import (
    ESTIMATORS,
    GROUP_ESTIMATORS,
    group_shaped_reward,
    min_group_size,
)
from .kl import (
    KL_ESTIMATORS,
    coati_logged_kl,
    kl_estimate,
    sequence_kl_reward,
)
from .masking import (
    ACTION_MASK_RULES,
    ProcessedSequences,
    last_valid_column,
    masked_row_mean,
    process_sequences,
    response_span,
)
from .presets import (
    DEFAULT_PRESET,
    PRESET_NAMES,
    PRESETS,
    AlgorithmConfig,
    preset_config,
)
from .resolve import KL_MODES, resolve_algorithm
from .rewards import (
    OVERLONG_LENGTHS,
    OVERLONG_VARIANTS,
    REWARD_PLACEMENTS,
    clip_reward,
    overlong_penalty,
    place_reward,
    response_length,
    stop_properly_penalty,
    token_rewards,
)
from .shaping import ShapedExperience, shape_experience

__all__ = [
    "ACTION_MASK_RULES",
    "AlgorithmConfig",
    "DEFAULT_PRESET",
    "ESTIMATORS",
    "GROUP_ESTIMATORS",
    "KL_ESTIMATORS",
    "KL_MODES",
    "OVERLONG_LENGTHS",
    "OVERLONG_VARIANTS",
    "PRESETS",
    "PRESET_NAMES",
    "ProcessedSequences",
    "REWARD_PLACEMENTS",
    "ShapedExperience",
    "WHITENINGS",
    "clip_advantages",
    "clip_fraction",
    "clip_filter_weights",
    "clip_reward",
    "coati_logged_kl",
    "cumulative_returns",
    "dynamic_sampling_mask",
    "gae",
    "group_shaped_reward",
    "high_entropy_mask",
    "kl_estimate",
    "last_valid_column",
    "masked_row_mean",
    "min_group_size",
    "overlong_penalty",
    "place_reward",
    "preset_config",
    "process_sequences",
    "resolve_algorithm",
    "response_length",
    "response_span",
    "sequence_kl_reward",
    "shape_experience",
    "stop_properly_penalty",
    "token_rewards",
    "whiten",
]
