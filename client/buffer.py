"""ExperienceBuffer: the trainer's replay buffer of experience rows (torch only).

Experiences are split into BufferItems (one per row) on `append`; `sample` and `iter_batches`
stack items back into Experiences with `make_experience_batch`, so every batch has the wire
layout of rollout.proto: prompt parts LEFT-padded to the widest prompt part P, response parts and
action-axis fields RIGHT-padded to the widest A, and action column j <-> token P + j in every
row. Rows keep their own padding (nothing is stripped), so a batch is as wide as its widest item
and every value a row arrived with (masked columns included) comes back unchanged.

Memory: items are views into their Experience's tensors. When `limit` evicts some rows of an
Experience, its storage lives on until its last row is evicted; eviction is oldest first, so at
most one Experience is held partially at any time.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .protocol.errors import InvalidArgument
from .protocol.experience import (
    BufferItem,
    Experience,
    make_experience_batch,
    split_experience_batch,
)

__all__ = ["ExperienceBuffer"]


class ExperienceBuffer:
    """Rows of experience for PPO/GRPO epochs and replay, oldest first.

    limit: most rows kept; appending beyond it drops the oldest rows first. 0 means unlimited.
    cpu_offload: move each Experience to CPU before storing it (frees accelerator memory
    between rollout and training; batches then come back on CPU).
    pad_token_id: the token that pads `sequences` when batching items of different widths.
    """

    def __init__(self, limit: int = 0, *, cpu_offload: bool = False, pad_token_id: int = 0):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise InvalidArgument(f"limit must be an int >= 0 (0: unlimited), got {limit!r}")
        self.limit = limit
        self.cpu_offload = cpu_offload
        self.pad_token_id = pad_token_id
        self._items: list[BufferItem] = []

    def append(self, experience: Experience) -> None:
        """Store every row of `experience`, then evict the oldest rows beyond `limit`."""
        if not isinstance(experience, Experience):
            raise TypeError(f"expected an Experience, got {type(experience).__name__}")
        if self.cpu_offload:
            experience = experience.to_device("cpu")
        self._items.extend(split_experience_batch(experience))
        overflow = len(self._items) - self.limit
        if self.limit and overflow > 0:
            del self._items[:overflow]

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> Experience:
        """`batch_size` distinct rows drawn uniformly at random, as one wire-layout Experience."""
        _check_batch_size(batch_size)
        if batch_size > len(self._items):
            raise InvalidArgument(
                f"sample: batch_size {batch_size} exceeds the {len(self._items)} rows held"
            )
        picks = torch.randperm(len(self._items), generator=generator)[:batch_size].tolist()
        return make_experience_batch([self._items[i] for i in picks], self.pad_token_id)

    def iter_batches(
        self,
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
    ) -> Iterator[Experience]:
        """One epoch: every row exactly once, in batches of `batch_size` (the last may be short
        unless `drop_last`). The rows are those held when the call is made."""
        _check_batch_size(batch_size)
        items = list(self._items)  # later appends or evictions do not disturb this epoch
        order = (
            torch.randperm(len(items), generator=generator).tolist()
            if shuffle
            else list(range(len(items)))
        )
        for start in range(0, len(order), batch_size):
            picks = order[start : start + batch_size]
            if drop_last and len(picks) < batch_size:
                return
            yield make_experience_batch([items[i] for i in picks], self.pad_token_id)

    @property
    def items(self) -> tuple[BufferItem, ...]:
        """The rows held, oldest first (a snapshot)."""
        return tuple(self._items)

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return (
            f"ExperienceBuffer(rows={len(self._items)}, limit={self.limit}, "
            f"cpu_offload={self.cpu_offload})"
        )


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgument(f"batch_size must be an int >= 1, got {batch_size!r}")
