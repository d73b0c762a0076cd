"""ExperienceBuffer: eviction order, sampled batches in the wire layout, epochs, CPU offload;
the framework layouts and LightRFT's buffer whitening against loops over lists."""

from __future__ import annotations

import math

import pytest
import torch
from rollserve.client.buffer import ExperienceBuffer
from rollserve.client.protocol.errors import InvalidArgument
from rollserve.client.protocol.experience import (
    EXPERIENCE_ACTION_FIELDS,
    EXPERIENCE_SEQUENCE_FIELDS,
    Experience,
    split_experience_batch,
)

PAD = 0


def build_experience(
    prompt_lens: list[int], response_lens: list[int], *, version: int, seed: int = 0
) -> Experience:
    """Rows in the wire layout (prompts left-, responses right-padded) with distinct values.

    Every row's tokens are unique across the test (offset by version), so rows can be
    recognised after re-batching; masked action columns carry non-zero values on purpose.
    """
    gen = torch.Generator().manual_seed(seed)
    b, p, a = len(prompt_lens), max(prompt_lens), max(response_lens)
    sequences = torch.full((b, p + a), PAD, dtype=torch.int64)  # (B, S)
    attention_mask = torch.zeros(b, p + a, dtype=torch.bool)  # (B, S)
    action_mask = torch.zeros(b, a, dtype=torch.bool)  # (B, A)
    for i, (lp, la) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        tokens = torch.arange(lp + la) + 1000 * version + 100 * i + 1
        sequences[i, p - lp : p + la] = tokens
        attention_mask[i, p - lp : p + la] = True
        action_mask[i, :la] = True

    def floats() -> torch.Tensor:
        return torch.randn(b, a, generator=gen)  # (B, A)

    return Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        action_log_probs=floats(),
        base_action_log_probs=floats(),
        reward=torch.randn(b, generator=gen),
        kl=floats(),
        advantages=floats(),
        returns=floats(),
        info={"response_length": torch.tensor(response_lens, dtype=torch.float32)},
        policy_version=torch.full((b,), version, dtype=torch.int64),
        prompt_index=torch.arange(b, dtype=torch.int64),
        response_texts=tuple(f"v{version}r{i}" for i in range(b)),
    )


def row_key(e: Experience, i: int) -> str:
    """The identity of row i (its response text, unique per row in these tests)."""
    assert e.response_texts is not None
    return e.response_texts[i]


def real_tokens(e: Experience, i: int) -> list[int]:
    return e.sequences[i][e.attention_mask[i]].tolist()


def test_limit_evicts_oldest_rows_first() -> None:
    buffer = ExperienceBuffer(limit=5)
    buffer.append(build_experience([2, 3, 1], [2, 2, 1], version=1))
    buffer.append(build_experience([1, 1], [3, 1], version=2))
    assert len(buffer) == 5  # exactly at the limit: nothing dropped
    buffer.append(build_experience([4, 2], [1, 4], version=3))
    assert len(buffer) == 5
    held = [(item.policy_version, item.prompt_index) for item in buffer.items]
    assert held == [(1, 2), (2, 0), (2, 1), (3, 0), (3, 1)]
    # One experience larger than the limit keeps only its newest rows.
    buffer.append(build_experience([1] * 7, [1] * 7, version=4))
    assert [item.prompt_index for item in buffer.items] == [2, 3, 4, 5, 6]
    assert {item.policy_version for item in buffer.items} == {4}


def test_zero_limit_is_unlimited_and_clear_empties() -> None:
    buffer = ExperienceBuffer()
    for version in range(1, 5):
        buffer.append(build_experience([2] * 10, [3] * 10, version=version))
    assert len(buffer) == 40
    buffer.clear()
    assert len(buffer) == 0
    assert list(buffer.iter_batches(4)) == []


def test_sample_rebatches_items_of_different_widths_in_the_wire_layout() -> None:
    narrow = build_experience([2, 1], [1, 2], version=1, seed=1)  # P = 2, A = 2
    wide = build_experience([5, 3], [4, 6], version=2, seed=2)  # P = 5, A = 6
    buffer = ExperienceBuffer()
    buffer.append(narrow)
    buffer.append(wide)
    originals = {row_key(e, i): (e, i) for e in (narrow, wide) for i in range(e.num_rows)}
    batch = buffer.sample(4, generator=torch.Generator().manual_seed(0))
    assert batch.sequences.shape == (4, 5 + 6)
    assert batch.action_mask.shape == (4, 6)
    assert batch.prompt_width == 5
    assert sorted(batch.response_texts or ()) == sorted(originals)  # each row once
    for i in range(batch.num_rows):
        source, j = originals[row_key(batch, i)]
        p_src = source.prompt_width
        n_prompt = int(source.attention_mask[j, :p_src].sum())
        n_resp = int(source.action_mask[j].sum())
        # Prompt part ends at column P, response part starts there: pads left, then right.
        expected_attention = [False] * (5 - n_prompt) + [True] * (n_prompt + n_resp)
        expected_attention += [False] * (6 - n_resp)
        assert batch.attention_mask[i].tolist() == expected_attention
        assert real_tokens(batch, i) == real_tokens(source, j)
        assert (batch.sequences[i][~batch.attention_mask[i]] == PAD).all()
        response = source.sequences[j, p_src : p_src + n_resp]
        assert torch.equal(batch.sequences[i, 5 : 5 + n_resp], response)
        # Action fields: the source's columns first (masked ones too), zeros to the right.
        a_src = source.num_actions
        for name in ("action_log_probs", "base_action_log_probs", "kl", "advantages", "returns"):
            got, want = getattr(batch, name)[i], getattr(source, name)[j]
            assert torch.equal(got[:a_src], want), name
            assert (got[a_src:] == 0).all(), name
        assert batch.action_mask[i].tolist() == [True] * n_resp + [False] * (6 - n_resp)
        assert batch.reward[i] == source.reward[j]
        assert batch.policy_version[i] == source.policy_version[j]
        assert batch.info["response_length"][i] == n_resp


def test_sample_draws_distinct_rows_reproducibly_and_checks_its_size() -> None:
    buffer = ExperienceBuffer()
    buffer.append(build_experience([2] * 6, [2] * 6, version=1))
    first = buffer.sample(3, generator=torch.Generator().manual_seed(7))
    again = buffer.sample(3, generator=torch.Generator().manual_seed(7))
    assert first.response_texts == again.response_texts
    assert len(set(first.response_texts or ())) == 3
    assert len(set(buffer.sample(6).response_texts or ())) == 6
    with pytest.raises(InvalidArgument, match="exceeds"):
        buffer.sample(7)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgument, match="batch_size"):
            buffer.sample(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("drop_last", [False, True])
def test_iter_batches_covers_every_row_once_per_epoch(drop_last: bool) -> None:
    buffer = ExperienceBuffer()
    buffer.append(build_experience([1, 2, 3, 4], [4, 3, 2, 1], version=1))
    buffer.append(build_experience([3, 1, 2], [1, 5, 2], version=2))
    buffer.append(build_experience([2, 2, 2, 2], [2, 2, 2, 2], version=3))
    everything = sorted(item.response_text or "" for item in buffer.items)  # 11 rows
    generator = torch.Generator().manual_seed(0)
    orders = []
    for _epoch in range(3):
        batches = list(buffer.iter_batches(4, drop_last=drop_last, generator=generator))
        sizes = [b.num_rows for b in batches]
        assert sizes == ([4, 4] if drop_last else [4, 4, 3])
        seen = [row_key(b, i) for b in batches for i in range(b.num_rows)]
        assert len(seen) == len(set(seen))
        if drop_last:
            assert set(seen) < set(everything)
        else:
            assert sorted(seen) == everything
        orders.append(seen)
    assert orders[0] != orders[1] or orders[1] != orders[2]  # shuffled between epochs


def test_iter_batches_without_shuffle_keeps_insertion_order() -> None:
    buffer = ExperienceBuffer()
    first = build_experience([1, 2], [2, 1], version=1)
    second = build_experience([3], [3], version=2)
    buffer.append(first)
    buffer.append(second)
    batches = list(buffer.iter_batches(2, shuffle=False))
    seen = [row_key(b, i) for b in batches for i in range(b.num_rows)]
    assert seen == ["v1r0", "v1r1", "v2r0"]
    # A batch of rows from one experience is that experience bit for bit (split inverts batch).
    assert torch.equal(batches[0].sequences, first.sequences)
    assert torch.equal(batches[0].kl, first.kl)


def test_iteration_is_a_snapshot_of_the_rows_held_at_the_call() -> None:
    buffer = ExperienceBuffer(limit=4)
    buffer.append(build_experience([1] * 4, [1] * 4, version=1))
    epoch = buffer.iter_batches(2, shuffle=False)
    next(epoch)
    buffer.append(build_experience([1] * 4, [1] * 4, version=2))  # evicts every v1 row
    rest = [row_key(b, i) for b in epoch for i in range(b.num_rows)]
    assert rest == ["v1r2", "v1r3"]


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.gpu,
        ),
    ],
)
def test_cpu_offload_stores_rows_on_cpu(device: str) -> None:
    experience = build_experience([2, 3], [3, 2], version=1)
    on_device = experience.to_device(device)
    buffer = ExperienceBuffer(cpu_offload=True)
    buffer.append(on_device)
    for item in buffer.items:
        tensors = [item.sequences, item.action_log_probs, item.reward, *item.info.values()]
        assert all(t.device.type == "cpu" for t in tensors)
    batch = buffer.sample(2, generator=torch.Generator().manual_seed(0))
    assert batch.sequences.device.type == "cpu"
    rows = {row_key(batch, i): i for i in range(2)}
    for j in range(2):
        i = rows[row_key(experience, j)]
        for name in ("sequences", "attention_mask", "action_mask", "kl", "advantages"):
            assert torch.equal(getattr(batch, name)[i], getattr(experience, name)[j]), name
    # Without offload the rows stay where they came from.
    kept = ExperienceBuffer()
    kept.append(on_device)
    assert kept.items[0].sequences.device.type == device
    assert kept.sample(1).advantages.device.type == device


def test_rejects_bad_arguments() -> None:
    for bad in (-1, 2.0, True):
        with pytest.raises(InvalidArgument, match="limit"):
            ExperienceBuffer(limit=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ExperienceBuffer().append(split_experience_batch(build_experience([1], [1], version=1)))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Framework layouts ("lightrft", "openrlhf"), against the rules written as loops over lists
# (docs/reference/experience_math.md section 6, "Buffer layouts")
# ---------------------------------------------------------------------------------------------

ACTION_FIELDS = EXPERIENCE_ACTION_FIELDS  # every (B, A) field, optional ones included
TOKEN_FIELDS = EXPERIENCE_SEQUENCE_FIELDS  # every (B, S) field


def ragged_experience(rows: list[tuple[int, list[int]]], *, version: int, seed: int) -> Experience:
    """Rows (prompt length, action mask of the response) in the wire layout, every optional
    field present, a per-token info entry and a per-row one. Masks are ragged: prefixes,
    one with a gap (multi-turn), one all false (dynamic sampling)."""
    gen = torch.Generator().manual_seed(seed)
    b = len(rows)
    p = max(lp for lp, _ in rows)
    a = max(len(mask) for _, mask in rows)
    sequences = torch.full((b, p + a), PAD, dtype=torch.int64)
    attention_mask = torch.zeros(b, p + a, dtype=torch.bool)
    action_mask = torch.zeros(b, a, dtype=torch.bool)
    for i, (lp, mask) in enumerate(rows):
        tokens = torch.arange(lp + len(mask)) + 1000 * version + 100 * i + 1
        sequences[i, p - lp : p + len(mask)] = tokens
        attention_mask[i, p - lp : p + len(mask)] = True
        action_mask[i, : len(mask)] = torch.tensor(mask, dtype=torch.bool)

    def floats() -> torch.Tensor:
        return torch.randn(b, a, generator=gen)  # masked columns carry values too

    return Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        action_log_probs=floats(),
        base_action_log_probs=floats(),
        values=floats(),
        reward=torch.randn(b, generator=gen),
        kl=floats(),
        advantages=floats(),
        returns=floats(),
        action_entropy=floats(),
        rollout_log_probs=floats(),
        info={
            "high_entropy_mask": (floats() > 0).float(),  # per token
            "response_length": torch.tensor([len(m) for _, m in rows], dtype=torch.int64),
        },
        policy_version=torch.full((b,), version, dtype=torch.int64),
        prompt_index=torch.arange(b, dtype=torch.int64),
        response_texts=tuple(f"v{version}r{i}" for i in range(b)),
    )


def expected_rows(e: Experience, layout: str) -> list[dict[str, list]]:
    """Each row of e, stripped as `layout` says, as plain lists (loops, no tensor ops)."""
    out = []
    for i in range(e.num_rows):
        seq = e.sequences[i].tolist()
        att = e.attention_mask[i].tolist()
        mask = e.action_mask[i].tolist()
        width, actions = len(seq), len(mask)
        prompt = width - actions
        first = next(t for t in range(width) if att[t])
        row: dict[str, list] = {}
        fields = {name: getattr(e, name)[i].tolist() for name in ACTION_FIELDS}
        fields["info:high_entropy_mask"] = e.info["high_entropy_mask"][i].tolist()
        if layout == "lightrft":
            invalid = sum(1 for v in mask if not v)
            for name in TOKEN_FIELDS:
                row[name] = (seq if name == "sequences" else att)[first : width - invalid]
            for name, values in fields.items():
                row[name] = values[: actions - invalid]
        else:  # openrlhf: per token, column c <-> token c + 1 of the row without its left pad
            tokens, attended = seq[first:], att[first:]
            trailing = 0
            while trailing < len(attended) and not attended[len(attended) - 1 - trailing]:
                trailing += 1
            kept = len(tokens) - trailing
            row["sequences"], row["attention_mask"] = tokens[:kept], attended[:kept]
            before = prompt - first - 1  # prompt tokens after the first: not actions
            for name, values in fields.items():
                zero = False if name == "action_mask" else 0.0
                row[name] = ([zero] * before + values)[: kept - 1]
        row["reward"] = e.reward[i].item()
        row["info:response_length"] = e.info["response_length"][i].item()
        row["response_text"] = (e.response_texts or ())[i]
        out.append(row)
    return out


def check_batch(batch: Experience, rows: list[dict[str, list]], layout: str) -> None:
    """batch == rows padded with zeros (left for lightrft, right for openrlhf), exactly."""

    def padded(values: list[list], zero: object) -> list[list]:
        width = max(len(v) for v in values)
        if layout == "lightrft":
            return [[zero] * (width - len(v)) + v for v in values]
        return [v + [zero] * (width - len(v)) for v in values]

    for name in (*TOKEN_FIELDS, *ACTION_FIELDS):
        zero = False if name in ("attention_mask", "action_mask") else 0
        got = getattr(batch, name)
        want = torch.tensor(padded([r[name] for r in rows], zero), dtype=got.dtype)
        assert got.shape == want.shape and torch.equal(got, want), name
    want = torch.tensor(padded([r["info:high_entropy_mask"] for r in rows], 0.0))
    assert torch.equal(batch.info["high_entropy_mask"], want)
    assert batch.reward.tolist() == [r["reward"] for r in rows]
    assert batch.info["response_length"].tolist() == [r["info:response_length"] for r in rows]
    assert list(batch.response_texts or ()) == [r["response_text"] for r in rows]


LAYOUT_ROWS = (
    [(2, [1, 1, 1]), (4, [1]), (1, [1, 0, 1, 1]), (3, [0, 0])],
    [(5, [1, 1, 1, 1, 1, 1]), (1, [1, 1])],
)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("layout", ["lightrft", "openrlhf"])
def test_framework_layouts_strip_on_append_and_zero_pad_on_sampling(
    layout: str, device: str
) -> None:
    experiences = [
        ragged_experience(list(rows), version=v, seed=v) for v, rows in enumerate(LAYOUT_ROWS)
    ]
    rows = [row for e in experiences for row in expected_rows(e, layout)]
    buffer = ExperienceBuffer(layout=layout, pad_token_id=99)  # the frameworks pad with 0
    for e in experiences:
        buffer.append(e.to_device(device))
    # Split: each held item is its row, stripped.
    for item, row in zip(buffer.items, rows, strict=True):
        assert item.sequences.tolist() == row["sequences"]
        assert item.action_mask.tolist() == row["action_mask"]
        assert item.advantages.tolist() == row["advantages"]
    # Sample: the rows re-padded with 0, in the drawn order (on the rows' device).
    (batch,) = buffer.iter_batches(len(rows), shuffle=False)
    assert batch.sequences.device.type == batch.info["high_entropy_mask"].device.type == device
    batch = batch.to_device("cpu")
    check_batch(batch, rows, layout)
    picks = torch.randperm(len(rows), generator=torch.Generator().manual_seed(5))[:4].tolist()
    sampled = buffer.sample(4, generator=torch.Generator().manual_seed(5))
    check_batch(sampled.to_device("cpu"), [rows[i] for i in picks], layout)
    # The gap row (its False entry taken for right padding by LightRFT) and the all-false row.
    gap, empty = rows[2], rows[3]
    if layout == "lightrft":
        assert gap["action_mask"] == [True, False, True] and empty["action_mask"] == []
        assert batch.prompt_width == batch.sequences.shape[1] - batch.num_actions
    else:
        assert batch.prompt_width == 1
        assert empty["action_mask"] == [False] * 4 and len(empty["sequences"]) == 5


def test_openrlhf_layout_batches_append_back_unchanged() -> None:
    buffer = ExperienceBuffer(layout="openrlhf")
    buffer.append(ragged_experience(list(LAYOUT_ROWS[0]), version=1, seed=1))
    buffer.append(ragged_experience(list(LAYOUT_ROWS[1]), version=2, seed=2))
    (batch,) = buffer.iter_batches(6, shuffle=False)
    again = ExperienceBuffer(layout="openrlhf")
    again.append(batch)
    (same,) = again.iter_batches(6, shuffle=False)
    for name in (*TOKEN_FIELDS, *ACTION_FIELDS, "reward"):
        assert torch.equal(getattr(same, name), getattr(batch, name)), name


def test_layout_is_checked_and_wire_stays_the_default() -> None:
    assert ExperienceBuffer().layout == "wire"
    with pytest.raises(InvalidArgument, match="layout"):
        ExperienceBuffer(layout="verl")


@pytest.mark.parametrize("divide_by_std", [True, False])
def test_lightrft_buffer_whitening_of_the_advantages(divide_by_std: bool) -> None:
    experiences = [
        ragged_experience(list(rows), version=v, seed=v) for v, rows in enumerate(LAYOUT_ROWS)
    ]
    rows = [row for e in experiences for row in expected_rows(e, "lightrft")]
    calls = []

    def all_reduce(t: torch.Tensor) -> torch.Tensor:  # two identical ranks
        calls.append(t.shape)
        return t * 2

    buffer = ExperienceBuffer(layout="lightrft")
    for e in experiences:
        buffer.append(e)
    buffer.normalize_advantages(divide_by_std=divide_by_std, all_reduce=all_reduce)
    # Every held entry (gap columns included) in the sum, the valid ones in the count.
    values = [x for row in rows for x in row["advantages"]]
    mask = [float(m) for row in rows for m in row["action_mask"]]
    mean = sum(values) / sum(mask)
    var = sum((x - mean) ** 2 * m for x, m in zip(values, mask, strict=True)) / sum(mask)
    scale = 1 / math.sqrt(max(var, 1e-8)) if divide_by_std else 1.0
    for item, row in zip(buffer.items, rows, strict=True):
        want = torch.tensor([(x - mean) * scale for x in row["advantages"]])
        torch.testing.assert_close(item.advantages, want, atol=1e-5, rtol=1e-5)
    assert len(calls) == (2 if divide_by_std else 1)
    with pytest.raises(InvalidArgument, match="layout 'lightrft'"):
        ExperienceBuffer().normalize_advantages()
    empty = ExperienceBuffer(layout="lightrft")
    empty.append(ragged_experience([(2, [0, 0])], version=3, seed=3))
    with pytest.raises(InvalidArgument, match="no valid action column"):
        empty.normalize_advantages()
