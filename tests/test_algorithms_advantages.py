"""GAE, cumulative returns, group estimators, whitening and the advantage clip.

Expected numbers are derived by hand (shown in comments) or with plain Python loops that
follow docs/reference/experience_math.md, never by calling the function under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from rollserve.server.algorithms import (
    clip_advantages,
    cumulative_returns,
    gae,
    group_shaped_reward,
    min_group_size,
    whiten,
)

F64 = torch.float64


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# ---------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------


def test_gae_by_hand_with_gamma_and_lambda_below_one() -> None:
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72).
    # Row 0, full mask, r = [0, 1], V = [0.5, 0.2]:
    #   t1: delta = 1 - 0.2 = 0.8, A1 = 0.8
    #   t0: delta = 0 + 0.9 * 0.2 - 0.5 = -0.32, A0 = -0.32 + 0.72 * 0.8 = 0.256
    # Row 1, short mask [1, 1, 0, 0] on r = [0.1, 1, 0.3, 0.5], V = [0.4, 0.6, 0.9, 0.7]:
    #   masked r = [0.1, 1, 0, 0], V = [0.4, 0.6, 0, 0]; A3 = A2 = 0
    #   t1: delta = 1 - 0.6 = 0.4, A1 = 0.4
    #   t0: delta = 0.1 + 0.9 * 0.6 - 0.4 = 0.24, A0 = 0.24 + 0.72 * 0.4 = 0.528
    rewards = _t([[0.0, 1.0, 0.0, 0.0], [0.1, 1.0, 0.3, 0.5]])
    values = _t([[0.5, 0.2, 0.0, 0.0], [0.4, 0.6, 0.9, 0.7]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    # Row 0 has A = 4 here with zero rewards and values past column 1, which changes nothing.
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, _t([[0.256, 0.8, 0.0, 0.0], [0.528, 0.4, 0.0, 0.0]]))
    # returns = A + V * m
    torch.testing.assert_close(ret, _t([[0.756, 1.0, 0.0, 0.0], [0.928, 1.0, 0.0, 0.0]]))


def test_gae_interior_gap_carries_the_recursion() -> None:
    # OpenRLHF quirk: mask [1, 0, 1], r = [0, 5, 1], V = [1, 2, 3], gamma = lam = 1.
    # masked r = [0, 0, 1], V = [1, 0, 3]: A2 = 1 - 3 = -2; A1 = (0 + 3 - 0) + (-2) = 1;
    # A0 = (0 + 0 - 1) + 1 = 0. The gap column gets gamma * V_next + gamma * lam * A_next = 1.
    adv, ret = gae(_t([[0, 5, 1]]), _t([[1, 2, 3]]), torch.tensor([[1, 0, 1]]), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, _t([[0.0, 1.0, -2.0]]))
    torch.testing.assert_close(ret, _t([[1.0, 1.0, 1.0]]))


def _coati_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """coati's loop: no mask inside, V_A = 0."""
    out = [0.0] * len(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        out[t] = running
    return out


def test_gae_on_coati_premasked_inputs_equals_coati_loop() -> None:
    # coati feeds V * m and rewards that are 0 past the response end; masking again is a no-op.
    torch.manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    values = torch.randn(3, 5, dtype=F64) * mask
    rewards = torch.randn(3, 5, dtype=F64) * mask
    adv, _ = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    expected = [
        _coati_gae(r, v, 0.99, 0.95) for r, v in zip(rewards.tolist(), values.tolist(), strict=True)
    ]
    torch.testing.assert_close(adv, _t(expected))


# ---------------------------------------------------------------------------------------------
# Cumulative returns
# ---------------------------------------------------------------------------------------------


def test_cumulative_returns_by_hand() -> None:
    # r = [1, 2, 3], m = [1, 1, 0], gamma 0.5: r * m = [1, 2, 0]; G2 = 0, G1 = 2, G0 = 1 + 1 = 2.
    # Row 1, gamma 0.5, full mask, r = [0, 0, 4]: G = [1, 2, 4].
    got = cumulative_returns(
        _t([[1, 2, 3], [0, 0, 4]]), torch.tensor([[1, 1, 0], [1, 1, 1]]), gamma=0.5
    )
    torch.testing.assert_close(got, _t([[2.0, 2.0, 0.0], [1.0, 2.0, 4.0]]))


def test_cumulative_returns_gamma_one_is_reverse_cumsum() -> None:
    rewards = _t([[0.5, -1.0, 2.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    got = cumulative_returns(rewards, mask, gamma=1.0)
    torch.testing.assert_close(got, _t([[1.5, 1.0, 2.0, 0.0]]))


# ---------------------------------------------------------------------------------------------
# Group estimators
# ---------------------------------------------------------------------------------------------

GROUPS = [[1.0, 2.0, 4.0], [3.0, 3.0, 3.0]]  # the second group has zero variance


def _flat(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([x for row in rows for x in row], dtype=F64)


def _group_norm_expected(eps: float) -> list[float]:
    out = []
    for group in GROUPS:
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        out += [0.0 if std == 0 else (x - mean) / (std + eps) for x in group]
    return out


@pytest.mark.parametrize("eps", [1e-4, 1e-9])
def test_group_norm(eps: float) -> None:
    got = group_shaped_reward(_flat(GROUPS), 3, "group_norm", eps=eps)
    torch.testing.assert_close(got, torch.tensor(_group_norm_expected(eps), dtype=F64))
    # The zero-variance group gives exactly 0.
    assert got[3:].tolist() == [0.0, 0.0, 0.0]


def test_rloo_by_hand() -> None:
    # Group [1, 2, 4]: R - (sum - R) / 2 = [1 - 3, 2 - 2.5, 4 - 1.5].
    got = group_shaped_reward(_flat(GROUPS), 3, "rloo", eps=0.0)
    torch.testing.assert_close(got, _t([[-2.0, -0.5, 2.5, 0.0, 0.0, 0.0]]).flatten())


@pytest.mark.parametrize("estimator", ["dr_grpo", "reinforce_baseline"])
def test_mean_baselines_by_hand(estimator: str) -> None:
    # mean of [1, 2, 4] = 7/3
    got = group_shaped_reward(_flat(GROUPS), 3, estimator, eps=1e-9)
    expected = [1 - 7 / 3, 2 - 7 / 3, 4 - 7 / 3, 0.0, 0.0, 0.0]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F64))


@pytest.mark.parametrize("estimator", ["gae", "reinforce"])
def test_non_group_estimators_leave_rewards_alone(estimator: str) -> None:
    rewards = _flat(GROUPS)
    assert torch.equal(group_shaped_reward(rewards, 3, estimator, eps=1e-9), rewards)


def test_group_norm_of_equal_float32_rewards_is_exactly_zero() -> None:
    # 3 x 0.1 in float32: the mean is off by one ulp, so R - mean and the std are tiny but not
    # 0 and their ratio would be noise; a constant group must give 0.
    rewards = torch.full((3,), 0.1, dtype=torch.float32)
    assert group_shaped_reward(rewards, 3, "group_norm", eps=1e-9).tolist() == [0.0, 0.0, 0.0]


def test_groups_are_consecutive_rows() -> None:
    # Two groups of 2: [0, 1] and [10, 30]; a strided grouping would mix them.
    got = group_shaped_reward(torch.tensor([0.0, 1.0, 10.0, 30.0], dtype=F64), 2, "dr_grpo", eps=0)
    assert got.tolist() == [-0.5, 0.5, -10.0, 10.0]


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo", "reinforce_baseline"])
def test_single_sample_groups_give_zero(estimator: str) -> None:
    got = group_shaped_reward(torch.tensor([0.3, -2.0, 5.0], dtype=F64), 1, estimator, eps=1e-9)
    assert got.tolist() == [0.0, 0.0, 0.0]


def test_rloo_needs_two_samples_per_prompt() -> None:
    # The request decoder refuses smaller groups (INVALID_ARGUMENT naming samples_per_prompt:
    # test_maker.py); called directly, the estimator refuses them rather than dividing by 0.
    assert min_group_size("rloo") == 2
    assert min_group_size("group_norm") == 1  # allowed: defined as 0
    with pytest.raises(ValueError, match="rloo"):
        group_shaped_reward(torch.tensor([1.0, 2.0]), 1, "rloo", eps=0.0)


# ---------------------------------------------------------------------------------------------
# Whitening and clipping
# ---------------------------------------------------------------------------------------------

ADV = [[1.0, 2.0, 9.0], [3.0, 7.0, 7.0]]
ADV_MASK = [[1, 1, 0], [1, 0, 0]]  # valid entries 1, 2, 3: mean 2, biased var 2/3, unbiased 1


def test_global_whitening_changes_masked_columns() -> None:
    got = whiten(_t(ADV), torch.tensor(ADV_MASK), "global")
    scale = 1 / math.sqrt(2 / 3)
    expected = [[(x - 2) * scale for x in row] for row in ADV]
    torch.testing.assert_close(got, _t(expected))
    assert got[0, 2].item() == pytest.approx(7 * scale)  # a masked column, shifted and scaled


def test_global_mean_whitening_only_subtracts() -> None:
    got = whiten(_t(ADV), torch.tensor(ADV_MASK), "global_mean")
    torch.testing.assert_close(got, _t([[x - 2 for x in row] for row in ADV]))


def test_unbiased_whitening() -> None:
    got = whiten(_t(ADV), torch.tensor(ADV_MASK), "unbiased", eps=1e-9)
    torch.testing.assert_close(got, _t([[(x - 2) / (1 + 1e-9) for x in row] for row in ADV]))


def test_global_whitening_variance_floor() -> None:
    # All valid entries equal: var = 0 -> rsqrt(1e-8) = 1e4; valid entries become 0.
    got = whiten(_t([[5.0, 5.0, 6.0]]), torch.tensor([[1, 1, 0]]), "global")
    torch.testing.assert_close(got, _t([[0.0, 0.0, 1e4]]))


def test_whitening_none_and_empty_mask_are_identity() -> None:
    adv = _t(ADV)
    assert torch.equal(whiten(adv, torch.tensor(ADV_MASK), "none"), adv)
    for mode in ("global", "global_mean", "unbiased"):
        assert torch.equal(whiten(adv, torch.zeros(2, 3, dtype=torch.bool), mode), adv)


def test_advantage_clip() -> None:
    adv = _t([[-3.0, 0.5, 2.0]])
    assert clip_advantages(adv, 1.0).tolist() == [[-1.0, 0.5, 1.0]]
    assert torch.equal(clip_advantages(adv, 0.0), adv)
