"""Scalar reward clip, overlong penalties, reward placement and the token reward (hand numbers)."""

from __future__ import annotations

import pytest
import torch
from rollserve.server.algorithms import (
    clip_reward,
    last_valid_column,
    overlong_penalty,
    place_reward,
    response_length,
    response_span,
    stop_properly_penalty,
    token_rewards,
)

F64 = torch.float64
# Row 0 short, row 1 with no valid column, row 2 full.
MASK = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
REWARD = torch.tensor([2.0, 3.0, 4.0], dtype=F64)


def test_clip_reward() -> None:
    assert clip_reward(torch.tensor([-7.0, 3.0, 12.0]), 5.0).tolist() == [-5.0, 3.0, 5.0]
    assert clip_reward(torch.tensor([-7.0, 12.0]), 0.0).tolist() == [-7.0, 12.0]


def test_last_valid_column_and_empty_row_fallback() -> None:
    assert last_valid_column(MASK).tolist() == [1, 2, 2]


def test_place_last_puts_empty_rows_reward_at_last_column() -> None:
    got = place_reward(REWARD, MASK, "last")
    assert got.tolist() == [[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 4.0]]


def test_place_every_adds_to_every_valid_column() -> None:
    got = place_reward(REWARD, MASK, "every")
    assert got.tolist() == [[2.0, 2.0, 0.0], [0.0, 0.0, 0.0], [4.0, 4.0, 4.0]]


@pytest.mark.parametrize("placement", ["last", "every"])
def test_token_rewards_subtract_beta_kl_everywhere(placement: str) -> None:
    kl = torch.tensor([[0.5, 1.0, 3.0], [2.0, 0.0, 1.0], [0.0, -1.0, 1.0]], dtype=F64)
    got = token_rewards(REWARD, MASK, placement=placement, kl=kl, kl_coef=0.1)
    placed = place_reward(REWARD, MASK, placement).tolist()
    # Not re-masked: the KL of masked columns stays (the returns mask the rewards later).
    expected = [
        [p - 0.1 * k for p, k in zip(pr, kr, strict=True)]
        for pr, kr in zip(placed, kl.tolist(), strict=True)
    ]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=F64))
    assert torch.equal(
        token_rewards(REWARD, MASK, placement=placement), place_reward(REWARD, MASK, placement)
    )


def test_overlong_penalty_variants() -> None:
    # Budget 10, buffer 4, factor 1: excess x = L - 6.
    lengths = torch.tensor([5.0, 6.0, 8.0, 10.0, 13.0])
    capped = overlong_penalty(
        lengths, max_new_tokens=10, buffer_tokens=4, factor=1.0, variant="capped"
    )
    uncapped = overlong_penalty(
        lengths, max_new_tokens=10, buffer_tokens=4, factor=1.0, variant="uncapped"
    )
    # x = [-1, 0, 2, 4, 7]: capped -min(x, 4)/4 for x > 0; uncapped min(0, -x/4).
    assert capped.tolist() == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert uncapped.tolist() == [0.0, 0.0, -0.5, -1.0, -1.75]
    half = overlong_penalty(
        lengths, max_new_tokens=10, buffer_tokens=4, factor=0.5, variant="capped"
    )
    assert half.tolist() == [0.0, 0.0, -0.25, -0.5, -0.5]


def test_overlong_penalty_disabled() -> None:
    lengths = torch.tensor([100.0])
    assert overlong_penalty(
        lengths, max_new_tokens=10, buffer_tokens=0, factor=1.0, variant="capped"
    ).tolist() == [0.0]
    assert overlong_penalty(
        lengths, max_new_tokens=10, buffer_tokens=4, factor=0.0, variant="uncapped"
    ).tolist() == [0.0]


def test_response_span_counts_gaps_and_count_does_not() -> None:
    gaps = torch.tensor([[1, 0, 0, 1], [0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert response_span(gaps).tolist() == [4, 2, 0, 4]
    assert response_length(gaps, "span", F64).tolist() == [4.0, 2.0, 0.0, 4.0]
    assert response_length(gaps, "count", F64).tolist() == [2.0, 2.0, 0.0, 4.0]
    with pytest.raises(ValueError, match="overlong length"):
        response_length(gaps, "tokens", F64)


def test_stop_properly_penalty_overrides_or_scales_truncated_rows() -> None:
    reward = torch.tensor([2.0, -1.0, 0.5], dtype=F64)
    truncated = torch.tensor([True, True, False])
    assert stop_properly_penalty(reward, truncated, -0.5).tolist() == [-0.5, -0.5, 0.5]
    assert stop_properly_penalty(reward, truncated, 0.25).tolist() == [0.5, -0.25, 0.5]
    assert stop_properly_penalty(reward, truncated, 0.0).tolist() == [0.0, 0.0, 0.5]
