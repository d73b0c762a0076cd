"""LightRFT extras: high-entropy token mask, dynamic sampling, clip-filter weights."""

from __future__ import annotations

import torch
from rollserve.server.algorithms import (
    clip_filter_weights,
    dynamic_sampling_mask,
    high_entropy_mask,
)

ENTROPY = torch.tensor(
    [[0.5, 2.0, 1.0, 3.0, 9.0], [1.0, 1.0, 0.2, 0.0, 0.0], [4.0, 4.0, 4.0, 4.0, 4.0]]
)
MASK = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)


def test_high_entropy_mask_by_hand() -> None:
    got = high_entropy_mask(ENTROPY, MASK, 0.5)
    # Row 0: n = 4, k = 2; H * m = [0.5, 2, 1, 3, 0] -> columns 3 and 1 (the masked 9 is 0).
    # Row 1: n = 3, k = max(1, floor(1.5)) = 1; tie 1.0 / 1.0 -> the lower column.
    # Row 2: no valid token -> nothing.
    assert got.dtype == torch.float32
    assert got.tolist() == [[0, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]


def test_high_entropy_mask_keeps_at_least_one_token() -> None:
    got = high_entropy_mask(ENTROPY, MASK, 0.1)  # floor(0.4) = 0 -> k = 1
    assert got.sum(dim=-1).tolist() == [1.0, 1.0, 0.0]
    assert got[0, 3].item() == 1.0


def test_high_entropy_mask_out_of_range_ratio_returns_mask_copy() -> None:
    for ratio in (0.0, -1.0, 1.0, 2.0):
        got = high_entropy_mask(ENTROPY, MASK, ratio)
        assert got.dtype == torch.float32
        assert torch.equal(got, MASK.float())


def test_dynamic_sampling_zeroes_all_zero_and_all_one_groups() -> None:
    rewards = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    mask = torch.ones(8, 3, dtype=torch.bool)
    mask[5, 2] = False
    got = dynamic_sampling_mask(rewards, mask, 2)
    assert got[:4].sum().item() == 0  # groups [0, 0] and [1, 1]
    assert torch.equal(got[4:], mask[4:])  # mixed group and a constant 0.5 group are kept


def test_clip_filter_weights_by_hand() -> None:
    # 4 prompts x 2 samples; prompts 0 and 2 have equal rewards: |z| = 2, G / (G - |z|) = 2.
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 0.0, 3.0])
    assert clip_filter_weights(rewards, 2, 3.0).tolist() == [1, 1, 2, 2, 1, 1, 2, 2]
    assert clip_filter_weights(rewards, 2, 1.5).tolist() == [1, 1, 1.5, 1.5, 1, 1, 1.5, 1.5]
    lam = clip_filter_weights(rewards, 2, 3.0, zero_var_weight=0.25).tolist()
    assert lam == [0.25, 0.25, 2, 2, 0.25, 0.25, 2, 2]


def test_clip_filter_weights_all_constant_are_one() -> None:
    assert clip_filter_weights(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2, 3.0).tolist() == [1, 1, 1, 1]
    assert clip_filter_weights(torch.tensor([0.2, 0.7, 0.9]), 1, 3.0).tolist() == [1, 1, 1]
