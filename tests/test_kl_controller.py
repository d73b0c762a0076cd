"""The trainer-side KL controllers and the mean-KL helper (hand-computed numbers)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from rollserve.client.kl_controller import AdaptiveKLController, FixedKLController, mean_kl


def test_fixed_controller_never_moves() -> None:
    controller = FixedKLController(0.05)
    assert controller.update(100.0, 10_000) == 0.05
    assert controller.value == 0.05


def test_adaptive_controller_by_hand() -> None:
    controller = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    # 9 / 6 - 1 = 0.5 -> clipped to 0.2; 0.1 * (1 + 0.2 * 1000 / 10000) = 0.102
    assert controller.update(9.0, 1000) == pytest.approx(0.102)
    # 6.6 / 6 - 1 = 0.1; 0.102 * (1 + 0.1 * 500 / 10000) = 0.10251
    assert controller.update(6.6, 500) == pytest.approx(0.10251)
    # 0 / 6 - 1 = -1 -> clipped to -0.2; a full horizon shrinks by 20 %.
    assert controller.update(0.0, 10_000) == pytest.approx(0.10251 * 0.8)
    assert controller.value == pytest.approx(0.10251 * 0.8)
    # On target: no change.
    before = controller.value
    controller.update(6.0, 10_000)
    assert controller.value == pytest.approx(before)


@pytest.mark.parametrize(
    "args", [(-0.1, 6.0, 100.0), (0.1, 0.0, 100.0), (0.1, 6.0, 0.0), (float("nan"), 6.0, 100.0)]
)
def test_adaptive_controller_rejects_bad_settings(args: tuple[float, float, float]) -> None:
    with pytest.raises(ValueError):
        AdaptiveKLController(*args)


def test_fixed_controller_rejects_negative() -> None:
    with pytest.raises(ValueError):
        FixedKLController(-1.0)


def test_mean_kl_is_mean_of_row_masked_means() -> None:
    experience = SimpleNamespace(
        kl=torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]]),
        action_mask=torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool),
    )
    # Rows: (1 + 2) / 2 = 1.5 and 4; the row with no valid token is left out.
    assert mean_kl(experience) == pytest.approx(2.75)
    other = SimpleNamespace(
        kl=torch.tensor([[0.5, 0.5]]), action_mask=torch.tensor([[True, False]])
    )
    assert mean_kl(experience, other) == pytest.approx((1.5 + 4 + 0.5) / 3)
    empty = SimpleNamespace(kl=torch.ones(2, 2), action_mask=torch.zeros(2, 2, dtype=torch.bool))
    assert mean_kl(empty) == 0.0


def test_kl_controller_module_does_not_import_transformers() -> None:
    code = (
        "import sys, rollserve.client.kl_controller; "
        "sys.exit(1 if 'transformers' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
