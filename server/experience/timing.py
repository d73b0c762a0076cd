"""Wall-clock seconds of each phase of a generation batch, and the info tensors that carry them.

Phases, in the order a batch runs them (steps.py): generate, score_actor, score_reference,
score_critic, decode (response texts), score_reward_model, rewards (rule, function and endpoint
sources), shape (KL, shaping, advantages). Every phase has its key in every Experience, 0 when
it did not run, so that rows of different requests still batch together (make_experience_batch
wants the same info keys in every row).

Convention (rollout.proto, Experience.info): info["time/<phase>_s"] is (B,) float32, each row
holding its generation batch's seconds in that phase divided by the batch's rows, so the sum of
a key over the rows of a request is the request's time in that phase (shaping over a whole
request, when advantages are whitened, is spread over all of its rows the same way).
info["time/generated_tokens_per_s"] is the row's generation batch's response tokens per second
of generation (a rate: for a request, divide the summed response_length by the summed
time/generate_s instead of averaging it).

On CUDA each phase boundary synchronises the device, so a phase is charged for the kernels it
launched rather than for the ones of the phase before it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["PHASES", "PhaseClock", "TOKENS_PER_S_KEY", "phase_key", "per_row_times"]

PHASES = (
    "generate",
    "score_actor",
    "score_reference",
    "score_critic",
    "decode",
    "score_reward_model",
    "rewards",
    "shape",
)
TOKENS_PER_S_KEY = "time/generated_tokens_per_s"


def phase_key(phase: str) -> str:
    """The info key of one phase's seconds."""
    return f"time/{phase}_s"


class PhaseClock:
    """Seconds per phase of one batch: `with clock.phase("generate"): ...` adds to its total."""

    def __init__(self, device: torch.device) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._cuda = device.type == "cuda"
        self._device = device

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self._device)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in self.seconds:
            raise ValueError(f"unknown phase {name!r}; phases: {PHASES}")
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start


def per_row_times(
    seconds: dict[str, float], rows: int, generated_tokens: int
) -> dict[str, torch.Tensor]:
    """The info tensors of one batch of `rows` rows (see the module docstring), on the CPU."""
    info = {
        phase_key(phase): torch.full((rows,), seconds.get(phase, 0.0) / rows, dtype=torch.float32)
        for phase in PHASES
    }
    rate = generated_tokens / seconds["generate"] if seconds.get("generate", 0.0) > 0 else 0.0
    info[TOKENS_PER_S_KEY] = torch.full((rows,), rate, dtype=torch.float32)
    return info
