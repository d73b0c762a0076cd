"""The resolved algorithm options (`AlgorithmConfig`) and the three named presets.

A preset is a complete AlgorithmConfig holding one framework's defaults, plus per-estimator
overrides for the defaults that depend on the estimator (ColossalChat's GRPO branch differs
from its PPO branch). The sources are the frameworks' own experience makers (ColossalChat's
coati, OpenRLHF, LightRFT); the table lists every difference between them.

    option                     coati (V2)        openrlhf              lightrft
    estimator (critic / none)  gae / group_norm  gae / group_norm      group_norm / group_norm
    gamma, lam                 1, 0.95           1, 1                  1, 0.95
    kl_coef                    0.01              0.01                  0.01
    kl_estimator, clamp        k1, none          k1, +-10              k3, none
    KL masked before transform yes (-b*d*m)      no (log-probs zeroed) yes
    kl_mode                    reward; sequence  reward                reward
                               for group est.
    returned kl                coati's logged    the estimator         the estimator
                               e^g - 1 - d
    reward_placement           every             last                  last
    reward_clip                5; 0 for group    10                    0 (off)
    whitening                  none              global for gae,       global for gae,
                                                 reinforce,            reinforce,
                                                 reinforce_baseline    reinforce_baseline
    group_std_eps              1e-4              1e-9                  1e-9
    gamma forced to 1 for      (none)            rloo, group_norm,     reinforce_baseline
                                                 dr_grpo, r._baseline
    group advantage            broadcast over A  cumulative returns    cumulative returns
    cpgd (LightRFT's)          z-score per experience, (R - mean) / (std_biased + 1e-6) on the
                               valid columns; no whitening, no experience_norm
    overlong penalty variant   capped            capped (DAPO)         uncapped
    overlong length            response span     response span         valid columns
    advantage clip             after whitening   after whitening       per experience, before
                                                                       the whitening; not cpgd
    experience_norm applies to every estimator   every estimator       all but group_norm, cpgd
    action mask (option)       stop sequences    stop sequences        stop sequences, or
                                                                       process_sequences
    log-probs / temperature    raw logits        logits / temperature  raw logits
    invalid log-prob columns   kept              zeroed                kept
    running reward norm        off (option: "scale" R/std or "standardize" (R-mean)/std, per
                               experience in stream order, before the reward clip; LightRFT's)

Where a framework has no such option (coati has no overlong penalty, dr_grpo, ...), its
preset uses the nearest convention of that framework and the table says which.

Reproduced conventions: coati's reward on every valid token, coati's logged KL with its d >= 10
guard, OpenRLHF's whitening of masked columns and signed +-10 clamp of k1, OpenRLHF's overlong
length as the response span (first to last action column, so a multi-turn mask's gaps count)
and its ProRL truncation penalty (stop_properly_penalty, off by default as upstream),
LightRFT's uncapped overlong penalty on the count of valid columns, and LightRFT's order of
operations:
per-experience normalisation (its advantages_norm: `experience_norm`), then the advantage clip,
then the cross-batch whitening. An "experience" is LightRFT's Experience, one micro rollout
batch; here it is one streamed micro-batch (BatchingOptions.micro_batch_size rows, whole
groups), so shape_experience takes the request's micro-batch size (`experience_rows`).

LightRFT derives its masks after generation from the tokens (process_sequences: EOS appended
after each row's last token that is neither EOS nor pad, attention from the first such token to
it, action mask by the state token); a request gets the same with AlgorithmOptions
action_mask_rule "process_sequences" (any preset; "stop", the generator's mask, is every
preset's default).

Upstream defects (QUIRKS, below, with their source locations) are NOT reproduced by default:
the preset follows the framework's intent. A request that sets
AlgorithmOptions.reproduce_upstream_quirks gets them bit for bit, so that a team migrating from
the framework can check its numbers against ours (AlgorithmConfig.upstream_quirks).

LightRFT's running reward normalisation (--reward_running_norm, with or without
--reward_running_norm_minus_mean) is AlgorithmOptions.reward_running_norm ("scale",
"standardize"; off in every preset, as upstream): per experience, in stream order, after the
estimator's reward pre-processing and before the reward clip, the moments first take in the
experience's rewards, then normalise them (running_norm.py). Its state across steps is the
trainer's: the moments go out with each request and come back in every Experience, so any
replica may serve the next request.

Also not reproduced, and not behind the switch (the first two are trainer-side):
LightRFT's second whitening in its replay buffer (a trainer runs it with the client's
ExperienceBuffer(layout="lightrft").normalize_advantages, skipping group_norm as LightRFT skips
the estimator named exactly "group_norm"), LightRFT's GAE clip fraction (computed after its
clamp, so always 0; info["advantage_clip_frac"] is the share the clamp changed, per row over
valid columns), and NaN for a zero-variance group or n = 1 (we return 0).

Chosen against a framework: a negative kl_coef is INVALID_ARGUMENT in every preset, where
OpenRLHF (and LightRFT) treat it as 0: a sign error should be heard, and 0 gives their numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from .groups import ESTIMATORS, GROUP_ESTIMATORS

__all__ = [
    "AlgorithmConfig",
    "QUIRKS",
    "Preset",
    "PRESETS",
    "PRESET_NAMES",
    "DEFAULT_PRESET",
    "preset_config",
]


QUIRKS: Mapping[str, str] = MappingProxyType(
    {
        # LightRFT, lightrft/trainer/fast_exp_maker.py, FastExperienceMaker's per-experience
        # advantage loop (experience_math.md 3.5 step 5): `generate_kwargs.pop("gamma", 1.0)`
        # inside the loop, so only the first experience of a step sees the configured gamma.
        "gamma_first_experience_only": "lightrft",
        # LightRFT, lightrft/trainer/advantage_calculator.py, CPGDCalculator
        # (experience_math.md 3.5 step 4): the score is reward.sum(-1), which collapses the
        # usual 1-D reward to one scalar whose std is 0, so every advantage is 0.
        "cpgd_zero_for_scalar_rewards": "lightrft",
        # LightRFT, lightrft/models/actor_language.py, ActorLanguage.process_sequences (from
        # OpenRLHF's former openrlhf/models/actor.py, Actor.process_sequences; experience_math.md
        # 3.1): the EOS goes at min(last real token + 1, S - 1), so a row whose last column is
        # a real token (truncated) gets that token overwritten by EOS. Only with
        # action_mask_rule "process_sequences".
        "eos_overwrites_last_token": "lightrft",
    }
)
"""Upstream defects that AlgorithmOptions.reproduce_upstream_quirks reproduces: name ->
the preset (framework) that has it. The comment above each names its source."""


@dataclass(frozen=True)
class AlgorithmConfig:
    """Every algorithm option, resolved: what shape_experience and the engine do for a request."""

    preset: str
    estimator: str  # one of groups.ESTIMATORS
    gamma: float  # as requested; see effective_gamma for the one used
    lam: float
    kl_coef: float  # beta; 0 disables the KL term
    kl_estimator: str  # "k1" | "k2" | "k3"
    kl_clamp: float  # symmetric clamp of the per-token KL; 0 disables
    kl_mask_first: bool  # multiply the log-ratio by the action mask before the estimator
    kl_mode: str  # "reward" | "loss" | "sequence"
    coati_logged_kl: bool  # return coati's logged e^g - 1 - d as `kl` (when kl_estimator is k1)
    reward_placement: str  # "last" | "every"
    reward_clip: float  # clip of the (group-shaped) scalar reward; 0 disables
    whitening: str  # "none" | "global" | "global_mean" | "unbiased"
    whiten_estimators: frozenset[str]  # estimators the whitening applies to
    whiten_eps: float  # added to the unbiased std by "unbiased" whitening
    advantage_clip: float  # 0 disables
    clip_estimators: frozenset[str]  # estimators the advantage clip applies to
    group_std_eps: float  # added to the group std by group_norm
    gamma_one_estimators: frozenset[str]  # estimators for which gamma is forced to 1
    broadcast_group_advantage: bool  # coati GRPO: group advantage repeated over all A columns
    high_entropy_token_ratio: float  # 0 disables info["high_entropy_mask"]
    dynamic_sampling: bool
    overlong_buffer: int  # tokens; 0 disables the overlong penalty
    overlong_factor: float
    overlong_variant: str  # "capped" (OpenRLHF) | "uncapped" (LightRFT)
    clip_filter_eps: float  # 0 disables info["clip_filter_weight"]
    clip_filter_lambda: float  # weight of zero-variance prompts (LightRFT's `lamda`)
    logprobs_use_temperature: bool  # divide logits by the sampling temperature for log-probs
    zero_invalid_logprobs: bool  # store 0 in the log-prob columns outside the action mask
    # LightRFT's advantages_norm: (A - mean) / (std_unbiased + whiten_eps) per experience.
    experience_norm: bool
    experience_norm_estimators: frozenset[str]  # estimators experience_norm applies to
    clip_before_whitening: bool  # LightRFT: clip per experience, then the cross-batch whitening
    overlong_length: str  # one of rewards.OVERLONG_LENGTHS: "span" (OpenRLHF) | "count"
    length_normalized_log_probs: bool  # coati: info["length_normalized_log_probs"] (B, A)
    stop_properly_penalty: float | None  # ProRL: truncated rows' R <- c if c < 0 else R * c
    upstream_quirks: frozenset[str]  # names from QUIRKS reproduced for this request
    # One of masking.ACTION_MASK_RULES: "stop" (the generator's) | "process_sequences" (LightRFT)
    action_mask_rule: str
    # One of running_norm.RUNNING_NORMS: LightRFT's running reward normalisation, "off" |
    # "scale" | "standardize"; its moments are the request's (ExperienceSpec.reward_moments).
    reward_running_norm: str = "off"

    @property
    def is_group_estimator(self) -> bool:
        return self.estimator in GROUP_ESTIMATORS

    @property
    def effective_gamma(self) -> float:
        """The discount actually used: 1 for the preset's gamma-forced estimators."""
        return 1.0 if self.estimator in self.gamma_one_estimators else self.gamma

    @property
    def effective_whitening(self) -> str:
        """The whitening actually applied to this estimator's advantages."""
        return self.whitening if self.estimator in self.whiten_estimators else "none"

    @property
    def broadcasts_sequence_advantage(self) -> bool:
        """coati GRPO: one advantage per row over all columns; only when the KL is not per token."""
        return (
            self.broadcast_group_advantage and self.is_group_estimator and self.kl_mode != "reward"
        )

    def gamma_of_experience(self, index: int) -> float:
        """The discount of the index-th experience of a request: effective_gamma, except for
        LightRFT's quirk (gamma for the first experience, 1 after) when it is reproduced."""
        if index > 0 and "gamma_first_experience_only" in self.upstream_quirks:
            return 1.0
        return self.effective_gamma

    @property
    def eos_over_last_token(self) -> bool:
        """LightRFT's process_sequences writes its EOS over a truncated row's last token."""
        return "eos_overwrites_last_token" in self.upstream_quirks

    @property
    def uses_advantage_clip(self) -> bool:
        return self.advantage_clip > 0 and self.estimator in self.clip_estimators

    @property
    def uses_experience_norm(self) -> bool:
        return self.experience_norm and self.estimator in self.experience_norm_estimators

    @property
    def uses_running_norm(self) -> bool:
        return self.reward_running_norm != "off"

    @property
    def shapes_whole_request(self) -> bool:
        """Whether shaping needs every row of the request at once: statistics over the request
        (whitening) or over experiences, the index of each experience (gamma quirk), or the
        running moments each experience hands to the next, in order (running norm)."""
        return (
            self.effective_whitening != "none"
            or self.uses_experience_norm
            or self.estimator == "cpgd"
            or "gamma_first_experience_only" in self.upstream_quirks
            or self.uses_running_norm
        )

    @property
    def needs_critic(self) -> bool:
        return self.estimator == "gae"

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def needs_entropy(self) -> bool:
        return self.high_entropy_token_ratio > 0

    @property
    def uses_overlong_penalty(self) -> bool:
        return self.overlong_buffer > 0 and self.overlong_factor > 0


@dataclass(frozen=True)
class Preset:
    """One framework's defaults: a base config plus estimator-dependent overrides."""

    base: AlgorithmConfig
    estimator_without_critic: str
    overrides: Mapping[str, Mapping[str, Any]]  # estimator -> {AlgorithmConfig field: value}
    quirks: frozenset[str] = frozenset()  # names from QUIRKS: this framework's defects


_COATI = AlgorithmConfig(
    preset="coati",
    estimator="gae",
    gamma=1.0,
    lam=0.95,
    kl_coef=0.01,
    kl_estimator="k1",
    kl_clamp=0.0,
    kl_mask_first=True,
    kl_mode="reward",
    coati_logged_kl=True,
    reward_placement="every",
    reward_clip=5.0,
    whitening="none",
    whiten_estimators=frozenset(),
    whiten_eps=1e-8,
    advantage_clip=0.0,
    clip_estimators=frozenset(ESTIMATORS),
    group_std_eps=1e-4,
    gamma_one_estimators=frozenset(),
    broadcast_group_advantage=True,
    high_entropy_token_ratio=0.0,
    dynamic_sampling=False,
    overlong_buffer=0,
    overlong_factor=0.0,
    overlong_variant="capped",
    clip_filter_eps=0.0,
    clip_filter_lambda=1.0,
    logprobs_use_temperature=False,
    zero_invalid_logprobs=False,
    experience_norm=False,
    experience_norm_estimators=frozenset(ESTIMATORS),
    clip_before_whitening=False,
    overlong_length="span",
    length_normalized_log_probs=False,
    stop_properly_penalty=None,
    upstream_quirks=frozenset(),
    action_mask_rule="stop",
    reward_running_norm="off",
)

_OPENRLHF = replace(
    _COATI,
    preset="openrlhf",
    lam=1.0,
    kl_clamp=10.0,
    kl_mask_first=False,
    coati_logged_kl=False,
    reward_placement="last",
    reward_clip=10.0,
    whitening="global",
    whiten_estimators=frozenset({"gae", "reinforce", "reinforce_baseline"}),
    group_std_eps=1e-9,
    gamma_one_estimators=frozenset({"rloo", "reinforce_baseline", "group_norm", "dr_grpo"}),
    broadcast_group_advantage=False,
    logprobs_use_temperature=True,
    zero_invalid_logprobs=True,
)

_LIGHTRFT = replace(
    _COATI,
    preset="lightrft",
    estimator="group_norm",
    kl_estimator="k3",
    coati_logged_kl=False,
    reward_placement="last",
    reward_clip=0.0,
    whitening="global",
    whiten_estimators=frozenset({"gae", "reinforce", "reinforce_baseline"}),
    group_std_eps=1e-9,
    gamma_one_estimators=frozenset({"reinforce_baseline"}),
    broadcast_group_advantage=False,
    overlong_variant="uncapped",
    overlong_length="count",
    # LightRFT's GroupNormCalculator and CPGDCalculator have no advantages_norm step.
    experience_norm_estimators=frozenset(ESTIMATORS) - {"group_norm", "cpgd"},
    # LightRFT's CPGDCalculator never reads advantage_clip (CPGD clips in its loss).
    clip_estimators=frozenset(ESTIMATORS) - {"cpgd"},
    clip_before_whitening=True,
)

_COATI_GRPO = MappingProxyType({"kl_mode": "sequence", "reward_clip": 0.0})

PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        # coati's GRPO branch folds the KL into the sequence reward and does not clip.
        "coati": Preset(
            _COATI, "group_norm", MappingProxyType({e: _COATI_GRPO for e in GROUP_ESTIMATORS})
        ),
        "openrlhf": Preset(_OPENRLHF, "group_norm", MappingProxyType({})),
        # LightRFT's GAE path adds 1e-9 to the std in advantages_norm; its REINFORCE path 1e-8.
        "lightrft": Preset(
            _LIGHTRFT,
            "group_norm",
            MappingProxyType({"gae": MappingProxyType({"whiten_eps": 1e-9})}),
            frozenset(name for name, preset in QUIRKS.items() if preset == "lightrft"),
        ),
    }
)
PRESET_NAMES: tuple[str, ...] = tuple(sorted(PRESETS))

DEFAULT_PRESET = "openrlhf"
"""The preset of a request that names none (reported by Health.default_preset).

This is the one place the default is chosen. OpenRLHF because it is the most widely used of
the three and the convention LightRFT inherits, its defaults are guards rather than surprises
(last-token reward, reward clip +-10, KL clamp +-10, global whitening for the critic and
REINFORCE estimators), and none of its reproduced behaviour is a bug we would have to skip.
Its PPO default needs a critic; without one the default estimator is group_norm (GRPO).
Its temperature convention (log-probs of logits / temperature) is a no-op at the default
sampling temperature of 1.
"""


def preset_config(
    name: str,
    estimator: str | None = None,
    *,
    has_critic: bool = True,
    reproduce_upstream_quirks: bool = False,
) -> AlgorithmConfig:
    """A preset's config for an estimator (default: the preset's own for this critic setup);
    with reproduce_upstream_quirks, the framework's defects too (QUIRKS)."""
    preset = PRESETS[name]
    if estimator is None:
        estimator = preset.base.estimator
        if estimator == "gae" and not has_critic:
            estimator = preset.estimator_without_critic
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {ESTIMATORS}")
    quirks = preset.quirks if reproduce_upstream_quirks else frozenset()
    return replace(
        preset.base,
        estimator=estimator,
        upstream_quirks=quirks,
        **preset.overrides.get(estimator, {}),
    )
