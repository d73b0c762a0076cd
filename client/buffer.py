"""ExperienceBuffer: the trainer's replay buffer of experience rows (torch only).

Experiences are split into BufferItems (one per row) on `append`; `sample` and `iter_batches`
stack items back into Experiences. The layout of those batches is the buffer's `layout`:

- "wire" (default): the wire layout of rollout.proto (`make_experience_batch`): prompt parts
  LEFT-padded to the widest prompt part P, response parts and action-axis fields RIGHT-padded to
  the widest A, action column j <-> token P + j in every row. Rows keep their own padding
  (nothing is stripped), so every value a row arrived with (masked columns included) comes back
  unchanged.
- "lightrft": LightRFT's replay buffer (OpenRLHF's NaiveReplayBuffer before its rewrite): each
  row is stripped on `append` (its left pad up to the first attended token; as many trailing
  columns as its action mask has False entries, from the tokens and the action fields), and a
  batch LEFT-pads every per-token field with 0 (sequences with token 0), so each row's last A'
  tokens are its A' action columns.
- "openrlhf": OpenRLHF's buffer since its rewrite: rows are per token (the action axis covers
  tokens 1 .. T-1, column j <-> token j + 1, zeros before the response), stripped of the left
  pad and of the trailing columns the attention mask does not cover; a batch RIGHT-pads every
  per-token field with 0. Such batches have prompt_width 1.

docs/reference/experience_math.md (section 6, "Buffer layouts") has the exact rules. The
framework layouts keep every rollserve field (kl, action_entropy, rollout_log_probs and
per-token info entries are stripped like the action fields) and ignore `pad_token_id`.

Memory: items are views into their Experience's tensors (the "openrlhf" layout copies the
action fields). When `limit` evicts some rows of an Experience, its storage lives on until its
last row is evicted; eviction is oldest first, so at most one Experience is held partially at
any time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch

from .protocol.errors import InvalidArgument
from .protocol.experience import (
    BufferItem,
    Experience,
    make_experience_batch,
    split_experience_batch,
)
from .protocol.experience.batching import check_same_presence
from .protocol.experience.fields import INDEX_SPECS, STEP_SPECS

__all__ = ["BUFFER_LAYOUTS", "ExperienceBuffer"]

BUFFER_LAYOUTS = ("wire", "lightrft", "openrlhf")


class ExperienceBuffer:
    """Rows of experience for PPO/GRPO epochs and replay, oldest first.

    limit: most rows kept; appending beyond it drops the oldest rows first. 0 means unlimited.
    cpu_offload: move each Experience to CPU before storing it (frees accelerator memory
    between rollout and training; batches then come back on CPU).
    pad_token_id: the token that pads `sequences` when batching items of different widths
    (the "wire" layout; the framework layouts pad with 0, as their buffers do).
    layout: one of BUFFER_LAYOUTS, the layout of the rows held and of the batches (module
    docstring).
    """

    def __init__(
        self,
        limit: int = 0,
        *,
        cpu_offload: bool = False,
        pad_token_id: int = 0,
        layout: str = "wire",
    ):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise InvalidArgument(f"limit must be an int >= 0 (0: unlimited), got {limit!r}")
        if layout not in BUFFER_LAYOUTS:
            raise InvalidArgument(f"layout must be one of {BUFFER_LAYOUTS}, got {layout!r}")
        self.layout = layout
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
        items = split_experience_batch(experience)
        strip = _STRIPS.get(self.layout)
        self._items.extend(items if strip is None else [strip(item) for item in items])
        overflow = len(self._items) - self.limit
        if self.limit and overflow > 0:
            del self._items[:overflow]

    def sample(self, batch_size: int, generator: torch.Generator | None = None) -> Experience:
        """`batch_size` distinct rows drawn uniformly at random, as one Experience in the
        buffer's layout."""
        _check_batch_size(batch_size)
        if batch_size > len(self._items):
            raise InvalidArgument(
                f"sample: batch_size {batch_size} exceeds the {len(self._items)} rows held"
            )
        picks = torch.randperm(len(self._items), generator=generator)[:batch_size].tolist()
        return self._batch([self._items[i] for i in picks])

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
            yield self._batch([items[i] for i in picks])

    def _batch(self, items: Sequence[BufferItem]) -> Experience:
        if self.layout == "wire":
            return make_experience_batch(items, self.pad_token_id)
        return _zero_padded_batch(items, left=self.layout == "lightrft")

    @property
    def items(self) -> tuple[BufferItem, ...]:
        """The rows held, oldest first (a snapshot), stripped as the layout says."""
        return tuple(self._items)

    def normalize_advantages(
        self,
        *,
        divide_by_std: bool = True,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """LightRFT's replay-buffer whitening of the advantages held ("lightrft" layout only):
        mu = (sum of every held advantage) / (valid columns), var = sum((A - mu)^2 * mask) /
        (valid columns), A <- (A - mu) * rsqrt(max(var, 1e-8)) on every held entry (only
        A - mu without divide_by_std). LightRFT's PPOTrainer runs it before each training phase
        for every estimator but the one named exactly "group_norm" (the trainer's call, not the
        buffer's). all_reduce: sums a tensor over the data-parallel ranks (e.g. a wrapper of
        torch.distributed.all_reduce that returns it), so every rank uses the global moments.
        """
        if self.layout != "lightrft":
            raise InvalidArgument(
                f"normalize_advantages: LightRFT's step, for layout 'lightrft', not {self.layout!r}"
            )
        if not self._items:
            return
        reduce = all_reduce or (lambda t: t)
        values = torch.cat([item.advantages for item in self._items]).float()  # every entry
        mask = torch.cat([item.action_mask for item in self._items]).float()
        total, count = reduce(torch.stack([values.sum(), mask.sum()]))
        if count.item() == 0:
            raise InvalidArgument("normalize_advantages: no valid action column is held")
        mean = total / count
        rstd = torch.ones((), dtype=values.dtype, device=values.device)
        if divide_by_std:
            var = reduce(((values - mean).pow(2) * mask).sum()) / count
            rstd = var.clamp(min=1e-8).rsqrt()
        self._items = [
            replace(item, advantages=(item.advantages - mean) * rstd) for item in self._items
        ]

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return (
            f"ExperienceBuffer(rows={len(self._items)}, limit={self.limit}, "
            f"cpu_offload={self.cpu_offload}, layout={self.layout!r})"
        )


def _check_batch_size(batch_size: int) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgument(f"batch_size must be an int >= 1, got {batch_size!r}")


# ---- framework layouts ---------------------------------------------------------------------


def _per_token_info(value: torch.Tensor, item: BufferItem) -> bool:
    """An info entry with one entry per action column (the wire batching's rule)."""
    return value.ndim >= 1 and value.shape[0] == item.num_actions


def _map_item(
    item: BufferItem,
    tokens: Callable[[torch.Tensor], torch.Tensor],
    actions: Callable[[torch.Tensor], torch.Tensor],
) -> BufferItem:
    """item with `tokens` applied to its (S,) fields and `actions` to its (A,) fields and
    per-token info entries."""
    changes: dict[str, object] = {}
    for spec in STEP_SPECS:
        value = getattr(item, spec.name)
        if value is not None and spec.axis:
            changes[spec.name] = (tokens if spec.axis == "S" else actions)(value)
    info = {k: actions(v) if _per_token_info(v, item) else v for k, v in item.info.items()}
    return replace(item, **changes, info=info)


def _strip_lightrft(item: BufferItem) -> BufferItem:
    """LightRFT's remove_padding_in_sequences: drop the left pad (up to the first attended
    token) and, from tokens and actions alike, as many trailing columns as the action mask has
    False entries (it assumes they are a suffix)."""
    width, actions = item.sequences.shape[0], item.num_actions
    invalid = int((~item.action_mask).sum())
    # Never past the prompt part, so that every kept action keeps its token.
    first = min(int(item.attention_mask.long().argmax()), width - actions)
    return _map_item(
        item,
        tokens=lambda t: t[first : width - invalid],
        actions=lambda t: t[: actions - invalid],
    )


def _strip_openrlhf(item: BufferItem) -> BufferItem:
    """OpenRLHF's rows since its rewrite: per token (action column j <-> token j + 1), without
    the left pad, then its remove_padding_in_sequences: drop the trailing columns the
    attention mask does not cover from every per-token field."""
    width, actions = item.sequences.shape[0], item.num_actions
    prompt = width - actions
    if prompt < 1:
        raise InvalidArgument("layout 'openrlhf': a row needs a token before its first action")
    first = min(int(item.attention_mask.long().argmax()), prompt - 1)
    length = width - first  # T: tokens from the first attended one
    trailing = int(item.attention_mask[first:].long().flip(0).argmax())
    kept = length - trailing
    offset = prompt - first - 1  # wire action column j is per-token column j + offset

    def per_token(value: torch.Tensor) -> torch.Tensor:
        out = value.new_zeros((length - 1, *value.shape[1:]))  # (T - 1, ...)
        out[offset : offset + actions] = value
        return out[: kept - 1]

    return _map_item(item, tokens=lambda t: t[first : first + kept], actions=per_token)


_STRIPS: dict[str, Callable[[BufferItem], BufferItem]] = {
    "lightrft": _strip_lightrft,
    "openrlhf": _strip_openrlhf,
}


def _zero_pad(rows: Sequence[torch.Tensor], width: int, *, left: bool) -> torch.Tensor:
    """Stack rows (n_i, ...) into (len(rows), width, ...), each padded with 0 on one side."""
    out = rows[0].new_zeros((len(rows), width, *rows[0].shape[1:]))
    for i, row in enumerate(rows):
        n = row.shape[0]
        if left:
            out[i, width - n :] = row
        else:
            out[i, :n] = row
    return out


def _zero_padded_batch(items: Sequence[BufferItem], *, left: bool) -> Experience:
    """The framework buffers' make_experience_batch: every per-token field padded with 0 to
    the longest item (LEFT for LightRFT, RIGHT for OpenRLHF), per-row values stacked."""
    if not items:
        raise InvalidArgument("make_experience_batch: no items")
    check_same_presence(items)
    first = items[0]
    widths = {
        "S": max(item.sequences.shape[0] for item in items),
        "A": max(item.num_actions for item in items),
    }
    fields: dict[str, object] = {}
    for spec in STEP_SPECS:
        rows = [getattr(item, spec.name) for item in items]
        if rows[0] is None:
            fields[spec.name] = None
        elif spec.axis:
            fields[spec.name] = _zero_pad(rows, widths[spec.axis], left=left)
        else:
            fields[spec.name] = torch.stack(rows)
    device = first.sequences.device
    for spec in INDEX_SPECS:
        values = [getattr(item, spec.name) for item in items]
        fields[spec.name] = torch.tensor(values, dtype=spec.dtype, device=device)
    info = {}
    for key in first.info:
        rows = [item.info[key] for item in items]
        if all(_per_token_info(row, item) for row, item in zip(rows, items, strict=True)):
            info[key] = _zero_pad(rows, widths["A"], left=left)
        elif all(row.shape == rows[0].shape for row in rows):
            info[key] = torch.stack(rows)
        else:
            raise InvalidArgument(f"info[{key!r}]: per-row shapes differ across items")
    texts = None if first.response_text is None else tuple(i.response_text for i in items)
    return Experience(**fields, info=info, response_texts=texts)  # type: ignore[arg-type]
