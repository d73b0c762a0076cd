"""Option resolution, and each preset end to end through shape_experience.

The end-to-end references below are each framework's formulas
(docs/reference/experience_math.md sections 1-3) written out as plain Python loops over lists;
they never call the functions under test.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from rollserve.client.protocol.errors import FailedPrecondition, InvalidArgument
from rollserve.server.algorithms import (
    DEFAULT_PRESET,
    PRESET_NAMES,
    AlgorithmConfig,
    resolve_algorithm,
    shape_experience,
)
from rollserve.v1 import rollout_pb2 as pb

F64 = torch.float64


def _resolve(
    has_critic: bool = True, default_preset: str = DEFAULT_PRESET, **options: Any
) -> AlgorithmConfig:
    return resolve_algorithm(
        pb.AlgorithmOptions(**options), default_preset=default_preset, has_critic=has_critic
    )


# ---------------------------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------------------------


def test_default_preset_is_documented_and_used_for_empty_preset() -> None:
    assert DEFAULT_PRESET == "openrlhf"
    assert DEFAULT_PRESET in PRESET_NAMES == ("coati", "lightrft", "openrlhf")
    assert _resolve().preset == DEFAULT_PRESET
    assert _resolve(default_preset="coati").preset == "coati"
    assert _resolve(default_preset="coati", preset="lightrft").preset == "lightrft"


def test_preset_defaults_follow_the_table() -> None:
    coati = _resolve(preset="coati")
    assert (coati.estimator, coati.kl_estimator, coati.kl_mode, coati.reward_placement) == (
        "gae",
        "k1",
        "reward",
        "every",
    )
    assert (coati.reward_clip, coati.group_std_eps, coati.effective_whitening) == (
        5.0,
        1e-4,
        "none",
    )
    assert (coati.gamma, coati.lam, coati.kl_coef) == (1.0, 0.95, 0.01)
    coati_grpo = _resolve(has_critic=False, preset="coati")
    assert (coati_grpo.estimator, coati_grpo.kl_mode, coati_grpo.reward_clip) == (
        "group_norm",
        "sequence",
        0.0,
    )
    assert coati_grpo.broadcasts_sequence_advantage

    openrlhf = _resolve(preset="openrlhf")
    assert (openrlhf.estimator, openrlhf.kl_estimator, openrlhf.kl_clamp, openrlhf.reward_clip) == (
        "gae",
        "k1",
        10.0,
        10.0,
    )
    assert (openrlhf.reward_placement, openrlhf.effective_whitening, openrlhf.lam) == (
        "last",
        "global",
        1.0,
    )
    assert openrlhf.logprobs_use_temperature and openrlhf.zero_invalid_logprobs
    assert _resolve(has_critic=False, preset="openrlhf").estimator == "group_norm"

    lightrft = _resolve(preset="lightrft")
    assert (lightrft.estimator, lightrft.kl_estimator, lightrft.kl_clamp, lightrft.reward_clip) == (
        "group_norm",
        "k3",
        0.0,
        0.0,
    )
    assert (
        lightrft.kl_mask_first
        and not lightrft.logprobs_use_temperature
        and not lightrft.zero_invalid_logprobs
    )
    assert lightrft.overlong_variant == "uncapped" and lightrft.group_std_eps == 1e-9
    assert _resolve(preset="lightrft", advantage_estimator="gae").whiten_eps == 1e-9


def test_request_values_override_preset_and_unset_fields_do_not() -> None:
    cfg = _resolve(
        preset="lightrft",
        kl_coef=0.25,
        kl_estimator="k2",
        reward_placement="every",
        reward_clip=3.0,
    )
    assert (cfg.kl_estimator, cfg.reward_placement, cfg.reward_clip) == ("k2", "every", 3.0)
    assert cfg.kl_coef == pytest.approx(0.25)
    assert cfg.lam == 0.95  # unset: the preset's
    # An explicit 0 is a value, not "unset".
    cfg = _resolve(preset="openrlhf", advantage_estimator="reinforce", gamma=0.0, kl_clamp=0.0)
    assert cfg.effective_gamma == 0.0 and cfg.kl_clamp == 0.0


def test_gamma_forcing_per_preset() -> None:
    # OpenRLHF forces gamma = 1 for rloo, reinforce_baseline, group_norm, dr_grpo.
    for estimator in ("rloo", "reinforce_baseline", "group_norm", "dr_grpo"):
        assert (
            _resolve(preset="openrlhf", advantage_estimator=estimator, gamma=0.5).effective_gamma
            == 1.0
        )
    assert (
        _resolve(preset="openrlhf", advantage_estimator="reinforce", gamma=0.5).effective_gamma
        == 0.5
    )
    # LightRFT only for reinforce_baseline.
    assert (
        _resolve(
            preset="lightrft", advantage_estimator="reinforce_baseline", gamma=0.5
        ).effective_gamma
        == 1.0
    )
    for estimator in ("rloo", "group_norm", "reinforce"):
        assert (
            _resolve(preset="lightrft", advantage_estimator=estimator, gamma=0.5).effective_gamma
            == 0.5
        )


def test_whitening_scope() -> None:
    # The preset's global whitening skips the group estimators...
    assert (
        _resolve(preset="openrlhf", advantage_estimator="group_norm").effective_whitening == "none"
    )
    assert _resolve(preset="openrlhf", advantage_estimator="rloo").effective_whitening == "none"
    assert (
        _resolve(preset="openrlhf", advantage_estimator="reinforce_baseline").effective_whitening
        == "global"
    )
    # ...but whitening asked for by name applies to any estimator.
    cfg = _resolve(preset="openrlhf", advantage_estimator="group_norm", whitening="unbiased")
    assert cfg.effective_whitening == "unbiased"


def test_coati_broadcast_only_without_per_token_kl() -> None:
    assert not _resolve(
        has_critic=False, preset="coati", kl_mode="reward"
    ).broadcasts_sequence_advantage
    assert _resolve(has_critic=False, preset="coati", kl_mode="loss").broadcasts_sequence_advantage


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"preset": "trl"}, "algorithm.preset"),
        ({"advantage_estimator": "ppo"}, "algorithm.advantage_estimator"),
        ({"kl_estimator": "k4"}, "algorithm.kl_estimator"),
        ({"kl_mode": "both"}, "algorithm.kl_mode"),
        ({"reward_placement": "first"}, "algorithm.reward_placement"),
        ({"whitening": "local"}, "algorithm.whitening"),
        ({"kl_coef": -0.1}, "algorithm.kl_coef"),
        ({"kl_coef": math.nan}, "algorithm.kl_coef"),
        ({"gamma": 1.5}, "algorithm.gamma"),
        ({"gamma": -0.1}, "algorithm.gamma"),
        ({"gamma": math.nan}, "algorithm.gamma"),
        ({"lam": 2.0}, "algorithm.lam"),
        ({"lam": -1.0}, "algorithm.lam"),
        ({"kl_clamp": -1.0}, "algorithm.kl_clamp"),
        ({"reward_clip": -1.0}, "algorithm.reward_clip"),
        ({"advantage_clip": -1.0}, "algorithm.advantage_clip"),
        ({"group_std_eps": -1.0}, "algorithm.group_std_eps"),
        ({"high_entropy_token_ratio": 1.5}, "algorithm.high_entropy_token_ratio"),
        ({"overlong_buffer": -1}, "algorithm.overlong_buffer"),
        ({"overlong_factor": -1.0}, "algorithm.overlong_factor"),
        ({"overlong_factor": 1.0}, "algorithm.overlong_buffer"),
        ({"clip_filter_eps": -1.0}, "algorithm.clip_filter_eps"),
        ({"stop_properly_penalty": math.nan}, "algorithm.stop_properly_penalty"),
        ({"stop_properly_penalty": math.inf}, "algorithm.stop_properly_penalty"),
        ({"overlong_length": "tokens"}, "algorithm.overlong_length"),
    ],
)
def test_invalid_options_name_the_field(options: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        _resolve(**options)
    assert caught.value.message.startswith(field + ":")


def test_unknown_name_lists_the_choices() -> None:
    with pytest.raises(InvalidArgument, match=r"unknown 'foo'; expected one of 'gae', 'reinforce'"):
        _resolve(advantage_estimator="foo")


def test_gae_without_critic_is_failed_precondition() -> None:
    with pytest.raises(FailedPrecondition, match="algorithm.advantage_estimator") as caught:
        _resolve(has_critic=False, advantage_estimator="gae")
    assert not isinstance(caught.value, InvalidArgument)


def test_every_algorithm_option_of_the_proto_is_resolved() -> None:
    # A field added to AlgorithmOptions must be handled (and this list updated) deliberately.
    handled = {
        "preset", "advantage_estimator", "gamma", "lam", "kl_coef", "kl_estimator", "kl_clamp",
        "kl_mode", "reward_placement", "reward_clip", "whitening", "advantage_clip",
        "group_std_eps", "high_entropy_token_ratio", "dynamic_sampling", "overlong_buffer",
        "overlong_factor", "clip_filter_eps", "reproduce_upstream_quirks", "experience_norm",
        "stop_properly_penalty", "overlong_length", "length_normalized_log_probs",
        "action_mask_rule", "reward_running_norm",
        # Not a config value: the request's running moments (ExperienceSpec.reward_moments,
        # decoded in server/experience/request.py; tests/test_running_reward_norm.py).
        "reward_moments",
    }  # fmt: skip
    assert {f.name for f in pb.AlgorithmOptions.DESCRIPTOR.fields} == handled
    cfg = _resolve(
        has_critic=False,
        preset="lightrft",
        advantage_estimator="rloo",
        lam=0.5,
        kl_clamp=2.0,
        advantage_clip=3.0,
        group_std_eps=0.5,
        high_entropy_token_ratio=0.25,
        dynamic_sampling=True,
        overlong_buffer=8,
        overlong_factor=0.5,
        clip_filter_eps=2.0,
        action_mask_rule="process_sequences",
        reward_running_norm="standardize",
    )
    assert (cfg.estimator, cfg.lam, cfg.kl_clamp, cfg.advantage_clip) == ("rloo", 0.5, 2.0, 3.0)
    assert cfg.action_mask_rule == "process_sequences"
    assert cfg.reward_running_norm == "standardize" and cfg.shapes_whole_request
    assert (cfg.group_std_eps, cfg.high_entropy_token_ratio, cfg.dynamic_sampling) == (
        0.5,
        0.25,
        True,
    )
    assert (cfg.overlong_buffer, cfg.overlong_factor, cfg.clip_filter_eps) == (8, 0.5, 2.0)


def test_unknown_default_preset_is_a_server_bug() -> None:
    with pytest.raises(ValueError, match="default preset"):
        _resolve(default_preset="trl")


# ---------------------------------------------------------------------------------------------
# End to end: a batch of 2 groups of 2 rows, A = 4, through shape_experience
# ---------------------------------------------------------------------------------------------

LENGTHS = [4, 2, 3, 1]
A = 4


def _batch(rewards: list[float]) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    lp = -torch.rand(4, A, generator=gen, dtype=F64) * 3
    ref = -torch.rand(4, A, generator=gen, dtype=F64) * 3
    lp[0, 1], ref[0, 1] = -0.1, -14.0  # d = 13.9 on a valid column: clamp and coati guard
    mask = torch.tensor([[t < n for t in range(A)] for n in LENGTHS])
    values = torch.randn(4, A, generator=gen, dtype=F64)
    entropy = torch.rand(4, A, generator=gen, dtype=F64) * 2
    return {
        "action_log_probs": lp,
        "base_action_log_probs": ref,
        "action_mask": mask,
        "values": values,
        "rewards": torch.tensor(rewards, dtype=F64),
        "entropy": entropy,
    }


def _lists(batch: dict[str, Any]) -> tuple[Any, ...]:
    keys = ("action_log_probs", "base_action_log_probs", "values")
    return tuple(None if batch[k] is None else batch[k].tolist() for k in keys)


def _masks() -> list[list[int]]:
    return [[1 if t < n else 0 for t in range(A)] for n in LENGTHS]


def _mean_std(xs: list[float]) -> tuple[float, float]:
    mean = sum(xs) / len(xs)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def _reverse_returns(r: list[float], m: list[int], gamma: float) -> list[float]:
    out, running = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        running = r[t] * m[t] + gamma * running
        out[t] = running
    return out


def _close(got: torch.Tensor, expected: list[Any]) -> None:
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), rtol=1e-10, atol=1e-10)


def _run(cfg: AlgorithmConfig, batch: dict[str, Any], max_new_tokens: int = A):
    return shape_experience(cfg, group_size=2, max_new_tokens=max_new_tokens, **batch)


def test_coati_ppo_end_to_end() -> None:
    cfg = _resolve(preset="coati")
    raw = [1.0, 0.0, 7.0, -6.0]
    batch = _batch(raw)
    out = _run(cfg, batch)
    lp, ref, values = _lists(batch)
    beta, gamma, lam = 0.01, 1.0, 0.95
    adv_all, ret_all, kl_all, kl_mean = [], [], [], []
    for i, n in enumerate(LENGTHS):
        d = [lp[i][t] - ref[i][t] for t in range(A)]
        m = [1 if t < n else 0 for t in range(A)]
        clipped = min(max(raw[i], -5.0), 5.0)
        # coati compute_reward: -beta * d * m + clip(R) for t < L, else 0 (every valid token).
        rew = [(-beta * d[t] * m[t] + clipped) if t < n else 0.0 for t in range(A)]
        v = [values[i][t] * m[t] for t in range(A)]
        adv, running = [0.0] * A, 0.0
        for t in reversed(range(A)):  # coati: no mask inside, V_A = 0
            next_v = v[t + 1] if t + 1 < A else 0.0
            running = rew[t] + gamma * next_v - v[t] + gamma * lam * running
            adv[t] = running
        adv_all.append(adv)
        ret_all.append([adv[t] + v[t] for t in range(A)])
        kl = [(math.exp(d[t] if d[t] < 10 else 0.0) - 1 - d[t]) * m[t] for t in range(A)]
        kl_all.append(kl)
        kl_mean.append(sum(kl) / n)
    _close(out.advantages, adv_all)
    _close(out.returns, ret_all)
    _close(out.kl, kl_all)
    _close(out.info["kl"], kl_mean)
    _close(out.reward, raw)  # coati stores the raw, unclipped reward
    assert out.kl[0, 1].item() == pytest.approx(-13.9)  # the d >= 10 guard


def test_coati_grpo_end_to_end() -> None:
    cfg = _resolve(has_critic=False, preset="coati")
    raw = [1.0, 0.0, 7.0, -6.0]
    batch = _batch(raw)
    batch["values"] = None
    out = _run(cfg, batch)
    lp, ref, _ = _lists(batch)
    beta = 0.01
    shaped = []
    for i, n in enumerate(LENGTHS):
        # k_i = sum(-beta * d * m) / sum(m), added to R before normalising; no clip.
        k = sum(-beta * (lp[i][t] - ref[i][t]) for t in range(n)) / n
        shaped.append(raw[i] + k)
    adv = []
    for g in (0, 2):
        mean, std = _mean_std(shaped[g : g + 2])
        adv += [(x - mean) / (std + 1e-4) for x in shaped[g : g + 2]]
    _close(out.reward, shaped)
    _close(out.info["sequence_kl"], [s - r for s, r in zip(shaped, raw, strict=True)])
    _close(out.advantages, [[a] * A for a in adv])  # broadcast over every column, masked too
    _close(out.returns, [[a] * A for a in adv])


def test_openrlhf_group_norm_end_to_end() -> None:
    # Default preset, no critic -> group_norm; the requested gamma is overridden by 1.
    cfg = _resolve(has_critic=False, gamma=0.5)
    raw = [1.0, 0.0, 30.0, -6.0]
    batch = _batch(raw)
    batch["values"] = None
    out = _run(cfg, batch)
    lp, ref, _ = _lists(batch)
    beta = 0.01
    shaped = []
    for g in (0, 2):
        mean, std = _mean_std(raw[g : g + 2])
        shaped += [min(max((x - mean) / (std + 1e-9), -10.0), 10.0) for x in raw[g : g + 2]]
    rewards_bt, returns, kl_all, lp_z = [], [], [], []
    for i, n in enumerate(LENGTHS):
        m = [1 if t < n else 0 for t in range(A)]
        lpz = [lp[i][t] * m[t] for t in range(A)]  # OpenRLHF stores 0 outside the mask
        refz = [ref[i][t] * m[t] for t in range(A)]
        kl = [min(max(lpz[t] - refz[t], -10.0), 10.0) for t in range(A)]  # k1, clamp +-10
        r = [-beta * kl[t] + (shaped[i] if t == n - 1 else 0.0) for t in range(A)]
        rewards_bt.append(r)
        returns.append(_reverse_returns(r, m, 1.0))
        kl_all.append(kl)
        lp_z.append(lpz)
    _close(out.action_log_probs, lp_z)
    _close(out.kl, kl_all)
    assert out.kl[0, 1].item() == 10.0
    _close(out.token_rewards, rewards_bt)
    _close(out.advantages, returns)  # group_norm is not whitened
    _close(out.returns, returns)
    _close(out.info["return"], [sum(r) for r in rewards_bt])
    _close(out.reward, raw)


def test_openrlhf_gae_with_global_whitening_end_to_end() -> None:
    cfg = _resolve(has_critic=True, preset="openrlhf")
    raw = [1.0, 0.0, 30.0, -6.0]
    batch = _batch(raw)
    out = _run(cfg, batch)
    lp, ref, values = _lists(batch)
    beta, masks = 0.01, _masks()
    adv_all, ret_all = [], []
    for i, n in enumerate(LENGTHS):
        m = masks[i]
        kl = [min(max(lp[i][t] * m[t] - ref[i][t] * m[t], -10.0), 10.0) for t in range(A)]
        clipped = min(max(raw[i], -10.0), 10.0)
        r = [(-beta * kl[t] + (clipped if t == n - 1 else 0.0)) * m[t] for t in range(A)]
        v = [values[i][t] * m[t] for t in range(A)]
        adv, running = [0.0] * A, 0.0
        for t in reversed(range(A)):  # gamma = lam = 1
            next_v = v[t + 1] if t + 1 < A else 0.0
            running = r[t] + next_v - v[t] + running
            adv[t] = running
        adv_all.append(adv)
        ret_all.append([adv[t] + v[t] for t in range(A)])
    valid = [
        a for row, m in zip(adv_all, masks, strict=True) for a, k in zip(row, m, strict=True) if k
    ]
    mean = sum(valid) / len(valid)
    var = sum((a - mean) ** 2 for a in valid) / len(valid)  # biased
    whitened = [
        [(a - mean) / math.sqrt(max(var, 1e-8)) for a in row] for row in adv_all
    ]  # every column
    _close(out.advantages, whitened)
    _close(out.returns, ret_all)  # returns are not whitened


def test_lightrft_group_norm_end_to_end() -> None:
    cfg = _resolve(has_critic=False, preset="lightrft", gamma=0.9)
    gamma = cfg.effective_gamma  # LightRFT keeps gamma for group_norm (0.9 as a proto float)
    assert gamma == pytest.approx(0.9)
    raw = [1.0, 0.0, 30.0, -6.0]
    batch = _batch(raw)
    batch["values"] = None
    out = _run(cfg, batch)
    lp, ref, _ = _lists(batch)
    beta = 0.01
    shaped = []
    for g in (0, 2):
        mean, std = _mean_std(raw[g : g + 2])
        shaped += [(x - mean) / (std + 1e-9) for x in raw[g : g + 2]]  # no reward clip
    kl_all, returns = [], []
    for i, n in enumerate(LENGTHS):
        m = [1 if t < n else 0 for t in range(A)]
        d = [(lp[i][t] - ref[i][t]) * m[t] for t in range(A)]  # mask first
        kl = [math.exp(-x) - 1 + x for x in d]  # k3, no clamp
        r = [-beta * kl[t] + (shaped[i] if t == n - 1 else 0.0) for t in range(A)]
        kl_all.append(kl)
        returns.append(_reverse_returns(r, m, gamma))
    _close(out.kl, kl_all)
    _close(out.advantages, returns)
    _close(out.returns, returns)
    _close(out.action_log_probs, batch["action_log_probs"].tolist())  # not zeroed


def test_lightrft_reinforce_baseline_with_extras_end_to_end() -> None:
    cfg = _resolve(
        has_critic=False,
        preset="lightrft",
        advantage_estimator="reinforce_baseline",
        gamma=0.9,  # forced to 1 for reinforce_baseline
        overlong_buffer=2,
        overlong_factor=1.0,
        dynamic_sampling=True,
        high_entropy_token_ratio=0.5,
        clip_filter_eps=3.0,
    )
    raw = [1.0, 1.0, 0.5, 0.0]  # the first group is all 1: dynamic sampling drops it
    batch = _batch(raw)
    batch["values"] = None
    out = _run(cfg, batch, max_new_tokens=4)
    lp, ref, _ = _lists(batch)
    beta = 0.01
    # Overlong (uncapped): x = L - (4 - 2); penalty min(0, -x / 2).
    penalised = [raw[i] + min(0.0, -(n - 2) / 2) for i, n in enumerate(LENGTHS)]
    masks = [[0] * A, [0] * A, *_masks()[2:]]
    shaped = []
    for g in (0, 2):
        mean = sum(penalised[g : g + 2]) / 2
        shaped += [x - mean for x in penalised[g : g + 2]]
    adv_rows, rewards_bt = [], []
    for i, n in enumerate(LENGTHS):
        d = [(lp[i][t] - ref[i][t]) * (t < n) for t in range(A)]  # KL keeps the original mask
        kl = [math.exp(-x) - 1 + x for x in d]
        last = max([t for t in range(A) if masks[i][t]], default=A - 1)
        r = [-beta * kl[t] + (shaped[i] if t == last else 0.0) for t in range(A)]
        rewards_bt.append(r)
        adv_rows.append(_reverse_returns(r, masks[i], 1.0))
    valid = [
        a for row, m in zip(adv_rows, masks, strict=True) for a, k in zip(row, m, strict=True) if k
    ]
    mean = sum(valid) / len(valid)
    var = sum((a - mean) ** 2 for a in valid) / len(valid)
    whitened = [[(a - mean) / math.sqrt(max(var, 1e-8)) for a in row] for row in adv_rows]
    _close(out.reward, penalised)
    assert out.action_mask.tolist() == [[bool(x) for x in row] for row in masks]
    _close(out.token_rewards, rewards_bt)
    _close(out.returns, adv_rows)
    _close(out.advantages, whitened)
    # Extras: top-k entropy over the filtered mask (k = max(1, floor(n / 2))), clip-filter weights.
    entropy = batch["entropy"].tolist()
    for i in range(4):
        n = sum(masks[i])
        chosen = (
            sorted(range(A), key=lambda t: -entropy[i][t] * masks[i][t])[: max(1, n // 2)]
            if n
            else []
        )
        assert out.info["high_entropy_mask"][i].tolist() == [
            1.0 if t in chosen else 0.0 for t in range(A)
        ]
    # Prompt 0 has equal rewards: |z| = 1 of G = 2 -> min(2 / 1, 3) = 2 for prompt 1, 1 for z.
    assert out.info["clip_filter_weight"].tolist() == [1.0, 1.0, 2.0, 2.0]


def test_kl_mode_loss_returns_kl_but_keeps_it_out_of_the_reward() -> None:
    cfg = _resolve(has_critic=False, preset="lightrft", kl_mode="loss")
    raw = [1.0, 0.0, 2.0, 0.5]
    batch = _batch(raw)
    batch["values"] = None
    out = _run(cfg, batch)
    assert out.kl.abs().sum().item() > 0
    # Only the group-normalised scalar at the last valid column; no -beta * kl anywhere.
    expected = [[0.0] * A for _ in LENGTHS]
    for g in (0, 2):
        mean, std = _mean_std(raw[g : g + 2])
        for i in (g, g + 1):
            expected[i][LENGTHS[i] - 1] = (raw[i] - mean) / (std + 1e-9)
    _close(out.token_rewards, expected)


def test_float32_inputs_stay_float32() -> None:
    batch = {
        k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in _batch([1.0, 0.0, 2.0, 0.5]).items()
    }
    out = _run(_resolve(has_critic=True), batch)
    for tensor in (
        out.kl,
        out.token_rewards,
        out.advantages,
        out.returns,
        out.reward,
        out.info["kl"],
    ):
        assert tensor.dtype == torch.float32


def test_contract_violations() -> None:
    batch = _batch([1.0, 0.0, 2.0, 0.5])
    # A request's group size is checked where it is decoded (test_maker.py); here it is the
    # caller's contract.
    with pytest.raises(ValueError, match="rloo"):
        shape_experience(
            _resolve(has_critic=False, advantage_estimator="rloo"),
            group_size=1,
            max_new_tokens=A,
            **batch,
        )
    with pytest.raises(ValueError, match="whole groups"):
        shape_experience(_resolve(has_critic=False), group_size=3, max_new_tokens=A, **batch)
    with pytest.raises(ValueError, match="reference"):
        _run(_resolve(), {**batch, "base_action_log_probs": None})
    with pytest.raises(ValueError, match="values"):
        _run(_resolve(has_critic=True), {**batch, "values": None})
    # Without a KL term the reference is optional and the KL is zero.
    out = _run(_resolve(has_critic=False, kl_coef=0.0), {**batch, "base_action_log_probs": None})
    assert out.kl.abs().sum().item() == 0.0


# ---------------------------------------------------------------------------------------------
# LightRFT's experiences: the gamma quirk, per-experience normalisation, clip, then whitening
# ---------------------------------------------------------------------------------------------


def _lightrft_shaped_reward(estimator: str, raw: list[float]) -> list[float]:
    """preprocess_rewards (experience_math.md 3.5 step 2), groups of 2 consecutive rows."""
    out = []
    for g in (0, 2):
        group = raw[g : g + 2]
        mean, std = _mean_std(group)
        for x in group:
            if estimator == "rloo":
                out.append(x - (sum(group) - x) / (len(group) - 1))
            elif estimator == "group_norm":
                out.append((x - mean) / (std + 1e-9))
            else:
                out.append(x)
    return out


def _lightrft_reference(
    estimator: str,
    raw: list[float],
    batch: dict[str, Any],
    *,
    gamma: float,
    clip: float,
    quirk: bool,
) -> tuple[list[list[float]], list[list[float]], list[float]]:
    """(advantages, returns, clip fraction per row) of FastExperienceMaker with advantages_norm
    and advantage_clip, experiences of 2 rows (3.5 steps 2-6), as loops over rows and columns."""
    lp, ref, values = _lists(batch)
    beta, lam, masks = 0.01, 0.95, _masks()
    shaped = _lightrft_shaped_reward(estimator, raw)
    adv_all, ret_all, frac = [], [], []
    for e in (0, 1):  # experiences: rows 0-1 and 2-3
        exp_gamma = gamma if (e == 0 or not quirk) else 1.0  # the quirk: 1.0 after the first
        if estimator == "reinforce_baseline":
            exp_gamma = 1.0
        rows = []
        for i in (2 * e, 2 * e + 1):
            m, n = masks[i], LENGTHS[i]
            d = [(lp[i][t] - ref[i][t]) * m[t] for t in range(A)]  # k3, mask first
            kl = [math.exp(-x) - 1 + x for x in d]
            r = [(-beta * kl[t] + (shaped[i] if t == n - 1 else 0.0)) * m[t] for t in range(A)]
            if estimator == "gae":
                v = [values[i][t] * m[t] for t in range(A)]
                adv, running = [0.0] * A, 0.0
                for t in reversed(range(A)):
                    next_v = v[t + 1] if t + 1 < A else 0.0
                    running = r[t] + exp_gamma * next_v - v[t] + exp_gamma * lam * running
                    adv[t] = running
                ret = [adv[t] + v[t] for t in range(A)]
            else:
                adv = _reverse_returns(r, m, exp_gamma)
                ret = list(adv)
            rows.append((adv, ret, m))
        if estimator != "group_norm":  # advantages_norm over this experience's valid entries
            valid = [a for adv, _, m in rows for a, k in zip(adv, m, strict=True) if k]
            mean, std = _mean_std(valid)
            eps = 1e-9 if estimator == "gae" else 1e-8
            rows = [([(a - mean) / (std + eps) for a in adv], ret, m) for adv, ret, m in rows]
        for adv, ret, m in rows:
            adv_all.append([min(max(a, -clip), clip) for a in adv])  # then the clip
            ret_all.append(ret)
            outside = [1 for a, k in zip(adv, m, strict=True) if k and abs(a) > clip]
            frac.append(len(outside) / sum(m))
    if estimator in ("gae", "reinforce", "reinforce_baseline"):  # cross-batch whitening
        pairs = zip(adv_all, masks, strict=True)
        valid = [a for row, m in pairs for a, k in zip(row, m, strict=True) if k]
        mean = sum(valid) / len(valid)
        var = sum((a - mean) ** 2 for a in valid) / len(valid)
        adv_all = [[(a - mean) / math.sqrt(max(var, 1e-8)) for a in row] for row in adv_all]
    return adv_all, ret_all, frac


def _close5(got: torch.Tensor, expected: list[Any]) -> None:
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quirk", [False, True])
@pytest.mark.parametrize("estimator", ["gae", "reinforce", "rloo", "group_norm"])
def test_lightrft_experiences_end_to_end(estimator: str, quirk: bool) -> None:
    gamma, clip = 0.5, 0.5  # exact in float32; the clip bites some entries of every estimator
    cfg = _resolve(
        preset="lightrft",
        advantage_estimator=estimator,
        gamma=gamma,
        experience_norm=True,
        advantage_clip=clip,
        reproduce_upstream_quirks=quirk,
    )
    assert cfg.shapes_whole_request == (estimator != "group_norm" or quirk)
    raw = [1.0, 0.0, 30.0, -6.0]
    batch = _batch(raw)
    if estimator != "gae":
        batch["values"] = None
    out = shape_experience(cfg, group_size=2, max_new_tokens=A, experience_rows=2, **batch)
    adv, ret, frac = _lightrft_reference(estimator, raw, batch, gamma=gamma, clip=clip, quirk=quirk)
    _close5(out.advantages, adv)
    _close5(out.returns, ret)
    _close5(out.info["advantage_clip_frac"], frac)
    assert 0 < sum(frac) < 4  # the clip bites some entries, not all
    if estimator == "group_norm":  # no advantages_norm, no whitening: only the clip
        assert out.advantages.abs().max().item() <= clip


def test_quirk_switch_is_per_framework() -> None:
    quirky = _resolve(preset="lightrft", gamma=0.5, reproduce_upstream_quirks=True)
    assert quirky.upstream_quirks == {
        "gamma_first_experience_only",
        "cpgd_zero_for_scalar_rewards",
        "eos_overwrites_last_token",
    }
    assert (quirky.gamma_of_experience(0), quirky.gamma_of_experience(1)) == (0.5, 1.0)
    assert quirky.shapes_whole_request
    intent = _resolve(preset="lightrft", gamma=0.5)
    assert not intent.upstream_quirks and intent.gamma_of_experience(3) == 0.5
    assert not intent.shapes_whole_request  # group_norm: no request-wide statistics
    # OpenRLHF and coati have no reproduced defect: the switch changes nothing.
    for preset in ("openrlhf", "coati"):
        assert not _resolve(preset=preset, reproduce_upstream_quirks=True).upstream_quirks


def test_lightrft_gamma_quirk_differs_from_intent() -> None:
    raw = [1.0, 0.0, 30.0, -6.0]
    outs = []
    for quirk in (False, True):
        cfg = _resolve(
            has_critic=False,
            preset="lightrft",
            advantage_estimator="reinforce",
            gamma=0.5,
            reproduce_upstream_quirks=quirk,
        )
        batch = {**_batch(raw), "values": None}
        outs.append(
            shape_experience(cfg, group_size=2, max_new_tokens=A, experience_rows=2, **batch)
        )
    # The first experience is the same; the second is discounted with 1.0 under the quirk.
    torch.testing.assert_close(outs[0].returns[:2], outs[1].returns[:2])
    assert not torch.allclose(outs[0].returns[2:], outs[1].returns[2:])


# ---------------------------------------------------------------------------------------------
# OpenRLHF's length penalties on multi-turn rows: overlong by response span, ProRL truncation
# ---------------------------------------------------------------------------------------------

# Action masks with gaps (environment tokens between turns), as OpenRLHF's agent rows have.
GAP_MASKS = [[1, 1, 0, 1], [1, 0, 0, 0], [0, 1, 1, 0], [1, 0, 1, 0]]
TRUNCATED = [True, False, True, False]


@pytest.mark.parametrize("coef", [-0.5, 0.5])
def test_openrlhf_reinforce_baseline_with_penalties_end_to_end(coef: float) -> None:
    clip = 1.25  # exact in float32, as the proto carries it
    cfg = _resolve(
        has_critic=False,
        preset="openrlhf",
        advantage_estimator="reinforce_baseline",
        gamma=0.5,  # forced to 1 for reinforce_baseline by OpenRLHF
        overlong_buffer=2,
        overlong_factor=1.0,
        stop_properly_penalty=coef,
        advantage_clip=clip,
    )
    raw = [1.0, 0.0, 30.0, -6.0]
    batch = {**_batch(raw), "values": None}
    batch["action_mask"] = torch.tensor(GAP_MASKS, dtype=torch.bool)
    out = shape_experience(
        cfg,
        group_size=2,
        max_new_tokens=A,
        truncated=torch.tensor(TRUNCATED),
        **batch,
    )
    lp, ref, _ = _lists(batch)
    beta, masks = 0.01, GAP_MASKS
    penalised = []
    for i, m in enumerate(masks):
        cols = [t for t in range(A) if m[t]]
        span = cols[-1] - cols[0] + 1  # response_length: first to last action column
        excess = min(span - (A - 2), 2)  # DAPO, capped at the buffer
        r = raw[i] + (-excess / 2 * 1.0 if excess > 0 else 0.0)
        if TRUNCATED[i]:  # ProRL: a fixed reward when c < 0, else scaled
            r = coef if coef < 0 else r * coef
        penalised.append(r)
    shaped = []
    for g in (0, 2):
        mean = sum(penalised[g : g + 2]) / 2
        shaped += [min(max(x - mean, -10.0), 10.0) for x in penalised[g : g + 2]]
    rows = []
    for i, m in enumerate(masks):
        kl = [min(max(lp[i][t] * m[t] - ref[i][t] * m[t], -10.0), 10.0) for t in range(A)]
        last = max(t for t in range(A) if m[t])
        r = [-beta * kl[t] + (shaped[i] if t == last else 0.0) for t in range(A)]
        rows.append(_reverse_returns(r, m, 1.0))
    valid = [
        a for row, m in zip(rows, masks, strict=True) for a, k in zip(row, m, strict=True) if k
    ]
    mean = sum(valid) / len(valid)
    var = sum((a - mean) ** 2 for a in valid) / len(valid)
    whitened = [[(a - mean) / math.sqrt(max(var, 1e-8)) for a in row] for row in rows]
    expected = [[min(max(a, -clip), clip) for a in row] for row in whitened]  # then clipped
    frac = [
        sum(1 for a, k in zip(row, m, strict=True) if k and abs(a) > clip) / sum(m)
        for row, m in zip(whitened, masks, strict=True)
    ]
    _close5(out.reward, penalised)
    _close5(out.returns, rows)
    _close5(out.advantages, expected)
    _close5(out.info["advantage_clip_frac"], frac)
    assert (out.advantages.abs() == clip).any()  # the clip bites


def test_overlong_length_follows_the_preset_and_the_request() -> None:
    assert _resolve(preset="openrlhf").overlong_length == "span"
    assert _resolve(preset="coati").overlong_length == "span"
    assert _resolve(preset="lightrft").overlong_length == "count"
    assert _resolve(preset="lightrft", overlong_length="span").overlong_length == "span"
    assert _resolve(preset="openrlhf").stop_properly_penalty is None  # off unless asked


def test_stop_properly_penalty_needs_truncated() -> None:
    cfg = _resolve(has_critic=False, stop_properly_penalty=0.0)
    with pytest.raises(ValueError, match="truncated"):
        _run(cfg, {**_batch([1.0, 0.0, 2.0, 0.5]), "values": None})


def test_no_clip_fraction_without_the_clip() -> None:
    out = _run(_resolve(has_critic=True), _batch([1.0, 0.0, 2.0, 0.5]))
    assert "advantage_clip_frac" not in out.info


# ---------------------------------------------------------------------------------------------
# LightRFT's CPGD, and coati's length-normalised log-probs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quirk", [False, True])
def test_lightrft_cpgd_end_to_end(quirk: bool) -> None:
    cfg = _resolve(
        has_critic=False,
        preset="lightrft",
        advantage_estimator="cpgd",
        gamma=0.5,  # CPGD does not discount
        overlong_buffer=2,  # CPGD scores the recipe reward, before the penalty
        overlong_factor=1.0,
        experience_norm=True,  # LightRFT's CPGD has no advantages_norm
        advantage_clip=0.5,  # nor does it read advantage_clip
        reproduce_upstream_quirks=quirk,
    )
    assert cfg.shapes_whole_request and cfg.effective_whitening == "none"
    raw = [1.0, 0.0, 30.0, -6.0]
    batch = {**_batch(raw), "values": None}
    out = shape_experience(cfg, group_size=2, max_new_tokens=A, experience_rows=2, **batch)
    masks = _masks()
    expected = []
    for e in (0, 1):  # experiences of 2 rows: z-score with the biased std + 1e-6
        scores = raw[2 * e : 2 * e + 2]
        mean = sum(scores) / len(scores)
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
        for i in (2 * e, 2 * e + 1):
            z = 0.0 if quirk else (raw[i] - mean) / (std + 1e-6)
            expected.append([z * masks[i][t] for t in range(A)])
    _close5(out.advantages, expected)
    _close5(out.returns, expected)
    assert "advantage_clip_frac" not in out.info
    if quirk:
        assert out.advantages.abs().sum().item() == 0.0
    else:
        assert out.advantages.abs().max().item() > 0.5  # unclipped


@pytest.mark.parametrize("preset", ["coati", "openrlhf"])
def test_cpgd_is_clipped_outside_lightrft(preset: str) -> None:
    cfg = _resolve(has_critic=False, preset=preset, advantage_estimator="cpgd", advantage_clip=0.5)
    raw = [1.0, 0.0, 30.0, -6.0]
    out = shape_experience(
        cfg, group_size=2, max_new_tokens=A, experience_rows=2, **{**_batch(raw), "values": None}
    )
    masks = _masks()
    expected, frac = [], []
    for e in (0, 1):
        scores = raw[2 * e : 2 * e + 2]
        mean = sum(scores) / len(scores)
        std = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
        for i in (2 * e, 2 * e + 1):
            z = (raw[i] - mean) / (std + 1e-6)
            expected.append([max(-0.5, min(0.5, z)) * masks[i][t] for t in range(A)])
            frac.append(float(abs(z) > 0.5) if sum(masks[i]) else 0.0)
    _close5(out.advantages, expected)
    _close5(out.info["advantage_clip_frac"], frac)


def test_length_normalized_log_probs() -> None:
    cfg = _resolve(has_critic=False, preset="coati", length_normalized_log_probs=True)
    batch = {**_batch([1.0, 0.0, 2.0, 0.5]), "values": None}
    out = _run(cfg, batch)
    lp, ref, _ = _lists(batch)
    for key, source in (
        ("length_normalized_log_probs", lp),
        ("length_normalized_base_log_probs", ref),
    ):
        expected = [
            [source[i][t] * (t < n) / (n + 0.01) for t in range(A)] for i, n in enumerate(LENGTHS)
        ]
        _close5(out.info[key], expected)
    assert "length_normalized_log_probs" not in _run(_resolve(has_critic=False), batch).info
