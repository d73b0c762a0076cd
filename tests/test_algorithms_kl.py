"""KL estimators, the clamp, mask-before-transform, coati's logged KL and the sequence KL term.

Expected values are computed here with plain Python floats from the formulas of
docs/reference/experience_math.md, never by calling the function under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from rollserve.server.algorithms import coati_logged_kl, kl_estimate, sequence_kl_reward

# Row 0: a masked last column with d != 0; row 1: d = 12.9 (past the clamp and coati's guard)
# and d = -2.8 (a negative log-ratio).
LOG_PROBS = [[-0.5, -1.0, -2.0], [-0.1, -3.0, -0.7]]
REF_LOG_PROBS = [[-0.7, -0.4, -0.5], [-13.0, -0.2, -0.1]]
MASK = [[True, True, False], [True, True, True]]


def _d() -> list[list[float]]:
    return [
        [a - b for a, b in zip(r1, r2, strict=True)]
        for r1, r2 in zip(LOG_PROBS, REF_LOG_PROBS, strict=True)
    ]


def _expected(estimator: str, *, masked: bool, clamp: float) -> list[list[float]]:
    out = []
    for row_d, row_m in zip(_d(), MASK, strict=True):
        row = []
        for d, m in zip(row_d, row_m, strict=True):
            d = d * m if masked else d
            value = {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[estimator]
            if clamp > 0:
                value = min(max(value, -clamp), clamp)
            row.append(value)
        out.append(row)
    return out


def _tensors(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(LOG_PROBS, dtype=dtype),
        torch.tensor(REF_LOG_PROBS, dtype=dtype),
        torch.tensor(MASK),
    )


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("clamp", [0.0, 10.0, 0.5])
def test_kl_estimators_match_formulas(estimator: str, masked: bool, clamp: float) -> None:
    lp, ref, mask = _tensors()
    got = kl_estimate(lp, ref, estimator=estimator, mask=mask if masked else None, clamp=clamp)
    expected = torch.tensor(_expected(estimator, masked=masked, clamp=clamp), dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_mask_first_zeroes_masked_columns_and_unmasked_does_not() -> None:
    lp, ref, mask = _tensors()
    for estimator in ("k1", "k2", "k3"):
        masked = kl_estimate(lp, ref, estimator=estimator, mask=mask)
        unmasked = kl_estimate(lp, ref, estimator=estimator)
        assert masked[0, 2].item() == 0.0
        assert unmasked[0, 2].item() != 0.0  # d = -1.5 there


def test_clamp_is_symmetric_and_bounds_k1_from_below() -> None:
    lp = torch.tensor([[0.0, -20.0]], dtype=torch.float64)
    ref = torch.tensor([[-20.0, 0.0]], dtype=torch.float64)
    got = kl_estimate(lp, ref, estimator="k1", clamp=10.0)
    assert got.tolist() == [[10.0, -10.0]]
    # k3 of d = -20 is e^20 - 21: huge, clamped to 10.
    assert kl_estimate(lp, ref, estimator="k3", clamp=10.0)[0, 1].item() == 10.0


def test_k3_is_nonnegative_and_zero_only_at_equal_log_probs() -> None:
    torch.manual_seed(0)
    lp = -torch.rand(4, 6, dtype=torch.float64) * 5
    ref = -torch.rand(4, 6, dtype=torch.float64) * 5
    assert (kl_estimate(lp, ref, estimator="k3") >= 0).all()
    assert kl_estimate(lp, lp, estimator="k3").abs().max().item() == 0.0


def test_low_precision_inputs_are_computed_in_float32() -> None:
    lp, ref, _ = _tensors(torch.bfloat16)
    assert kl_estimate(lp, ref, estimator="k3").dtype == torch.float32
    lp32, ref32, _ = _tensors(torch.float32)
    assert kl_estimate(lp32, ref32).dtype == torch.float32


def test_unknown_estimator_is_rejected() -> None:
    lp, ref, _ = _tensors()
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(lp, ref, estimator="k4")


def test_coati_logged_kl_orientation_and_guard() -> None:
    lp, ref, mask = _tensors()
    got = coati_logged_kl(lp, ref, mask)
    expected = []
    for row_d, row_m in zip(_d(), MASK, strict=True):
        # e^g - 1 - d with g = d if d < 10 else 0, times the mask.
        expected.append(
            [
                (math.exp(d if d < 10 else 0.0) - 1 - d) * m
                for d, m in zip(row_d, row_m, strict=True)
            ]
        )
    torch.testing.assert_close(
        got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12
    )
    # The guard: d = 12.9 gives -d, a negative "KL" (docs/reference/experience_math.md 5.3).
    assert got[1, 0].item() == pytest.approx(-12.9)
    # Orientation: for d = 0.2 it is e^0.2 - 1.2, not the usual e^-0.2 - 0.8.
    assert got[0, 0].item() == pytest.approx(math.exp(0.2) - 1.2)


def test_sequence_kl_reward_is_minus_beta_masked_mean() -> None:
    kl = torch.tensor([[0.2, -0.6, 5.0], [1.0, 1.0, 1.0], [3.0, 3.0, 3.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    got = sequence_kl_reward(kl, mask, 0.1)
    # Row 0: -0.1 * (0.2 - 0.6) / 2; row 2 has no valid token and gets 0, not NaN.
    torch.testing.assert_close(got, torch.tensor([0.02, -0.1, 0.0], dtype=torch.float64))
