"""The prompt source of the continuous rollout and the schedule of its batches.

Prompt source (--rollout-prompts FILE.jsonl): one JSON object per line, {"prompt": str} or
{"prompt_ids": [int, ...]}, each with an optional "gt_answer": str; every line of one kind; blank
lines are skipped and other keys ignored. A prompt's id is its row among the prompts (0-based,
blank lines not counted); it travels in Experience.prompt_index.

Schedule: every epoch visits each prompt once, in an order shuffled by a generator seeded with
(--rollout-seed, epoch); consecutive runs of --rollout-prompts-per-batch prompts form a batch (the
last one of an epoch may be smaller: batches never span epochs, so every prompt is made exactly
once per epoch). The rollout ends after --rollout-epochs epochs or --rollout-steps batches,
whichever comes first (0: no limit; both 0: it runs until the server stops).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..models import ModelLoadError

__all__ = [
    "PlannedBatch",
    "PromptSource",
    "RolloutSetupError",
    "SourcePrompt",
    "load_prompt_source",
    "mix_seed",
    "plan_batches",
]

_SEED_MASK = (1 << 63) - 1


class RolloutSetupError(ModelLoadError):
    """A prompt source or request template the server cannot use; fails the start like a model
    that cannot load (the CLI prints it without a traceback)."""


@dataclass(frozen=True)
class SourcePrompt:
    """One prompt of the source: text or token ids, and its ground-truth answer if any."""

    row: int  # the prompt id: its row among the prompts, from 0
    text: str | None
    token_ids: tuple[int, ...] | None
    gt_answer: str | None


@dataclass(frozen=True)
class PromptSource:
    """Every prompt of a JSONL file, all text or all token ids."""

    prompts: tuple[SourcePrompt, ...]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def is_text(self) -> bool:
        return self.prompts[0].text is not None

    @property
    def has_gt_answers(self) -> bool:
        return any(p.gt_answer is not None for p in self.prompts)


def load_prompt_source(path: str | Path) -> PromptSource:
    """Read a JSONL prompt file; RolloutSetupError naming the line of the first bad one."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise RolloutSetupError(f"cannot read the rollout prompts {path}: {exc}") from None
    prompts: list[SourcePrompt] = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            prompts.append(_parse_prompt(line, row=len(prompts), where=f"{path}:{number}"))
    if not prompts:
        raise RolloutSetupError(f"{path}: no prompts")
    if len({p.text is None for p in prompts}) > 1:
        raise RolloutSetupError(f"{path}: mixes prompt and prompt_ids lines; use one kind")
    return PromptSource(tuple(prompts))


def _parse_prompt(line: str, *, row: int, where: str) -> SourcePrompt:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise RolloutSetupError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(item, dict) or ("prompt" in item) == ("prompt_ids" in item):
        raise RolloutSetupError(f"{where}: expected an object with one of prompt, prompt_ids")
    gt_answer = item.get("gt_answer")
    if gt_answer is not None and not isinstance(gt_answer, str):
        raise RolloutSetupError(f"{where}: gt_answer must be a string")
    if "prompt" in item:
        text = item["prompt"]
        if not isinstance(text, str) or not text:
            raise RolloutSetupError(f"{where}: prompt must be a non-empty string")
        return SourcePrompt(row=row, text=text, token_ids=None, gt_answer=gt_answer)
    ids = item["prompt_ids"]
    valid = isinstance(ids, list) and ids and all(_is_token_id(t) for t in ids)
    if not valid:
        raise RolloutSetupError(f"{where}: prompt_ids must be a non-empty list of ids >= 0")
    return SourcePrompt(row=row, text=None, token_ids=tuple(ids), gt_answer=gt_answer)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class PlannedBatch:
    """One batch of the schedule: its position and the prompt rows it makes."""

    step: int  # from 0, across epochs
    epoch: int  # from 0
    rows: tuple[int, ...]


def mix_seed(seed: int, index: int) -> int:
    """A 63-bit seed for item `index` (an epoch, a step) of a run seeded with `seed`."""
    return (seed * 1_000_003 + index * 7_919 + 1) & _SEED_MASK


def plan_batches(
    num_prompts: int, prompts_per_batch: int, *, seed: int, epochs: int = 1, steps: int = 0
) -> Iterator[PlannedBatch]:
    """The rollout's batches in order; epochs / steps of 0 mean no limit."""
    if num_prompts < 1 or prompts_per_batch < 1:
        raise ValueError("plan_batches needs at least one prompt and one prompt per batch")
    step = epoch = 0
    while epochs == 0 or epoch < epochs:
        order = list(range(num_prompts))
        random.Random(mix_seed(seed, epoch)).shuffle(order)
        for start in range(0, num_prompts, prompts_per_batch):
            if steps and step >= steps:
                return
            yield PlannedBatch(
                step=step, epoch=epoch, rows=tuple(order[start : start + prompts_per_batch])
            )
            step += 1
        epoch += 1
