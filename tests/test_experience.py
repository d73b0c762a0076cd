"""Experience and BufferItem: validation, wire round trips, split/batch in the wire layout."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rollserve.client.protocol.codec import encode_tensor_into
from rollserve.client.protocol.errors import InvalidArgument, TensorCodecError
from rollserve.client.protocol.experience import (
    EXPERIENCE_ACTION_FIELDS,
    EXPERIENCE_SEQUENCE_FIELDS,
    EXPERIENCE_TENSOR_FIELDS,
    BufferItem,
    Experience,
    concat_experiences,
    experience_from_proto,
    experience_to_proto,
    make_experience_batch,
    split_experience_batch,
)
from rollserve.v1 import rollout_pb2 as pb

OPTIONAL_FIELDS = ("base_action_log_probs", "values", "action_entropy")


@dataclass(frozen=True)
class Batch:
    """A hand-built Experience plus the token lists it was built from."""

    experience: Experience
    prompts: list[list[int]]
    responses: list[list[int]]


def wire_layout(
    prompts: list[list[int]], responses: list[list[int]], pad: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sequences, attention_mask, action_mask as rollout.proto lays them out (the server's layout).

    Prompts left-padded to P = longest prompt, responses right-padded to A = longest response,
    prefix action masks.
    """
    b, p, a = len(prompts), max(map(len, prompts)), max(map(len, responses))
    sequences = torch.full((b, p + a), pad, dtype=torch.int64)  # (B, S)
    attention_mask = torch.zeros(b, p + a, dtype=torch.bool)  # (B, S)
    action_mask = torch.zeros(b, a, dtype=torch.bool)  # (B, A)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        row = torch.tensor(prompt + response, dtype=torch.int64)
        sequences[i, p - len(prompt) : p + len(response)] = row
        attention_mask[i, p - len(prompt) : p + len(response)] = True
        action_mask[i, : len(response)] = True
    return sequences, attention_mask, action_mask


def build_batch(
    prompt_lens: list[int],
    response_lens: list[int],
    *,
    seed: int = 0,
    pad: int = 0,
    optional: bool = True,
    texts: bool = True,
    version: int = 3,
    first_prompt: int = 0,
) -> Batch:
    """The wire layout (see `wire_layout`) with random tokens and random floats.

    Floats are random on masked columns too, so any stripping or shuffling shows.
    """
    gen = torch.Generator().manual_seed(seed)
    b, a = len(prompt_lens), max(response_lens)
    tokens = lambda n: torch.randint(3, 259, (n,), generator=gen).tolist()  # noqa: E731
    prompts = [tokens(n) for n in prompt_lens]
    responses = [tokens(n) for n in response_lens]
    sequences, attention_mask, action_mask = wire_layout(prompts, responses, pad)
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    exp = Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        action_log_probs=-randn(b, a).abs(),
        base_action_log_probs=-randn(b, a).abs() if optional else None,
        values=randn(b, a) if optional else None,
        reward=randn(b),
        kl=randn(b, a) * action_mask,
        advantages=randn(b, a),
        returns=randn(b, a),
        action_entropy=randn(b, a).abs() if optional else None,
        rollout_log_probs=-randn(b, a).abs() if optional else None,
        info={
            "response_length": torch.tensor(response_lens, dtype=torch.float32),
            "truncated": torch.tensor([n == a for n in response_lens]),
            "high_entropy_mask": randn(b, a) > 0,
            "token_pair": randn(b, a, 2),  # an action axis with a trailing dim
            "reward/reward_model": randn(b),
        },
        policy_version=torch.full((b,), version, dtype=torch.int64),
        prompt_index=torch.arange(first_prompt, first_prompt + b, dtype=torch.int64),
        response_texts=tuple(f"response {version}.{i}" for i in range(b)) if texts else None,
    )
    return Batch(exp, prompts, responses)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype, name
    assert got.shape == want.shape, name
    assert torch.equal(bits(got.cpu()), bits(want.cpu())), name


def assert_same_experience(got: Experience, want: Experience) -> None:
    for name in EXPERIENCE_TENSOR_FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        assert (g is None) == (w is None), name
        if w is not None:
            assert_bit_equal(g, w, name)
    assert got.info.keys() == want.info.keys()
    for key in want.info:
        assert_bit_equal(got.info[key], want.info[key], f"info[{key}]")
    assert got.response_texts == want.response_texts


# ------------------------------------------------------------------------------------------
# Construction and validation
# ------------------------------------------------------------------------------------------


def test_properties_and_frozenness() -> None:
    exp = build_batch([2, 5, 3], [4, 1, 6]).experience
    assert (exp.num_rows, exp.num_actions, exp.prompt_width) == (3, 6, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        exp.reward = torch.zeros(3)  # type: ignore[misc]
    listed = dataclasses.replace(exp, response_texts=["a", "b", "c"])
    assert listed.response_texts == ("a", "b", "c")  # normalised to an immutable tuple


def test_the_tensor_field_names_are_every_tensor_field_of_experience() -> None:
    # Read from the annotations, not from the specs the tuple is built from: a tensor field
    # added to Experience but not to the specs (so not sliced by the maker) fails here.
    hints = typing.get_type_hints(Experience)
    annotated = {
        f.name
        for f in dataclasses.fields(Experience)
        if hints[f.name] in (torch.Tensor, torch.Tensor | None)
    }
    assert "info" not in annotated and "sequences" in annotated  # the reading itself works
    assert sorted(EXPERIENCE_TENSOR_FIELDS) == sorted(annotated)


def test_the_axis_field_names_match_the_shapes_of_a_real_experience() -> None:
    # B = 3, S = 9, A = 5 all differ, so a shape names its axis without ambiguity.
    exp = build_batch([2, 4, 1], [3, 1, 5]).experience
    b, s, a = exp.num_rows, exp.sequences.shape[1], exp.num_actions
    assert len({b, s, a}) == 3
    shapes = {name: tuple(getattr(exp, name).shape) for name in EXPERIENCE_TENSOR_FIELDS}
    assert sorted(EXPERIENCE_SEQUENCE_FIELDS) == sorted(n for n, x in shapes.items() if x == (b, s))
    assert sorted(EXPERIENCE_ACTION_FIELDS) == sorted(n for n, x in shapes.items() if x == (b, a))
    assert all(x in {(b,), (b, s), (b, a)} for x in shapes.values()), shapes


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"kl": torch.zeros(3, 5)}, "experience.kl: expected shape (B, A) = (3, 6)"),
        (
            {"attention_mask": torch.ones(3, 10, dtype=torch.bool)},
            "experience.attention_mask: expected shape (B, S) = (3, 11)",
        ),
        ({"reward": torch.zeros(3, 1)}, "experience.reward: expected shape (B,)"),
        ({"values": torch.zeros(3, 6, dtype=torch.float64)}, "experience.values: expected dtype"),
        ({"sequences": torch.zeros(3, 11, dtype=torch.int32)}, "experience.sequences"),
        ({"policy_version": torch.zeros(3)}, "experience.policy_version"),
        ({"action_mask": torch.zeros(3, 6)}, "experience.action_mask: expected dtype"),
        ({"action_mask": torch.zeros(3, 12, dtype=torch.bool)}, "exceed"),
        ({"info": {"x": torch.zeros(2)}}, "experience.info['x']"),
        ({"info": {"x": torch.tensor(1.0)}}, "experience.info['x']"),
        ({"response_texts": ("a", "b")}, "experience.response_texts"),
        ({"advantages": None}, "experience.advantages is required"),
    ],
)
def test_inconsistent_experience_is_refused(change: dict, fragment: str) -> None:
    exp = build_batch([2, 5, 3], [4, 1, 6]).experience
    with pytest.raises(InvalidArgument) as excinfo:
        dataclasses.replace(exp, **change)
    assert fragment in str(excinfo.value)


# ------------------------------------------------------------------------------------------
# Wire
# ------------------------------------------------------------------------------------------


def wire_round_trip(exp: Experience) -> Experience:
    wire = experience_to_proto(exp).SerializeToString()
    return experience_from_proto(pb.Experience.FromString(wire))


@pytest.mark.parametrize("optional", [True, False])
def test_proto_round_trip_is_exact(optional: bool) -> None:
    exp = build_batch([3, 1, 4, 4], [2, 5, 0, 3], optional=optional, texts=optional).experience
    back = wire_round_trip(exp)
    assert_same_experience(back, exp)
    msg = experience_to_proto(exp)
    for name in OPTIONAL_FIELDS:
        assert msg.HasField(name) == optional  # None travels as an unset field
    assert len(msg.response_texts) == (4 if optional else 0)


def _valid_proto() -> pb.Experience:
    return experience_to_proto(build_batch([2, 5, 3], [4, 1, 6]).experience)


def _set(field: str, t: torch.Tensor):
    return lambda msg: encode_tensor_into(getattr(msg, field), t)


def _bad_bytes(msg: pb.Experience) -> None:
    msg.action_mask.data = msg.action_mask.data[:-1]


@pytest.mark.parametrize(
    "corrupt, error, fragment",
    [
        (
            _set("action_log_probs", torch.zeros(3, 7)),
            InvalidArgument,
            "experience.action_log_probs",
        ),
        (_set("values", torch.zeros(2, 6)), InvalidArgument, "experience.values"),
        (
            _set("returns", torch.zeros(3, 6, dtype=torch.float16)),
            InvalidArgument,
            "experience.returns",
        ),
        (
            _set("sequences", torch.zeros(3, 11, dtype=torch.int32)),
            InvalidArgument,
            "experience.sequences",
        ),
        (
            _set("prompt_index", torch.zeros(4, dtype=torch.int64)),
            InvalidArgument,
            "experience.prompt_index",
        ),
        (lambda m: m.ClearField("kl"), InvalidArgument, "experience.kl is required"),
        (lambda m: m.ClearField("sequences"), InvalidArgument, "experience.sequences is required"),
        (
            lambda m: m.info["x"].CopyFrom(
                pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2], data=bytes(8))
            ),
            InvalidArgument,
            "experience.info['x']",
        ),
        (lambda m: m.response_texts.append("extra"), InvalidArgument, "experience.response_texts"),
        (_bad_bytes, TensorCodecError, "experience.action_mask"),
        (lambda m: setattr(m.reward, "dtype", 99), TensorCodecError, "experience.reward"),
        (lambda m: m.info["y"].SetInParent(), TensorCodecError, "experience.info['y']"),
    ],
)
def test_from_proto_refuses_inconsistent_messages(corrupt, error: type, fragment: str) -> None:
    msg = _valid_proto()
    corrupt(msg)
    msg = pb.Experience.FromString(msg.SerializeToString())
    result = None
    with pytest.raises(error) as excinfo:
        result = experience_from_proto(msg)
    assert result is None
    assert fragment in str(excinfo.value)


# ------------------------------------------------------------------------------------------
# Split and batch
# ------------------------------------------------------------------------------------------


def test_split_gives_rows_with_the_batch_dim_removed() -> None:
    batch = build_batch([2, 5, 3], [4, 1, 6], version=7, first_prompt=10)
    exp = batch.experience
    items = split_experience_batch(exp)
    assert len(items) == 3
    for i, item in enumerate(items):
        assert isinstance(item, BufferItem)
        assert item.sequences.shape == (11,) and item.action_mask.shape == (6,)
        assert item.reward.shape == () and item.reward.item() == exp.reward[i].item()
        assert item.policy_version == 7 and isinstance(item.policy_version, int)
        assert item.prompt_index == 10 + i
        assert item.response_text == f"response 7.{i}"
        assert item.info["high_entropy_mask"].shape == (6,) and item.info["truncated"].shape == ()
        assert_bit_equal(item.values, exp.values[i], "values")  # nothing stripped


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=5),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_batching_the_split_rows_reproduces_the_experience(
    lengths: list[tuple[int, int]], optional: bool, seed: int
) -> None:
    prompt_lens, response_lens = map(list, zip(*lengths, strict=True))
    exp = build_batch(
        prompt_lens, response_lens, seed=seed, optional=optional, texts=optional
    ).experience
    assert_same_experience(make_experience_batch(split_experience_batch(exp)), exp)


ACTION_FIELDS = (
    "action_mask",
    "action_log_probs",
    "base_action_log_probs",
    "values",
    "kl",
    "advantages",
    "returns",
    "action_entropy",
)


def _check_row_in_wire_layout(
    merged: Experience, row: int, source: Batch, source_row: int, pad: int
) -> None:
    """Exact placement of every field of one merged row, taken from row `source_row` of `source`."""
    src = source.experience
    p, a = merged.prompt_width, merged.num_actions
    p_i, a_i = src.prompt_width, src.num_actions
    for name, fill in (("sequences", pad), ("attention_mask", False)):
        got, want = getattr(merged, name)[row], getattr(src, name)[source_row]
        assert (got[: p - p_i] == fill).all(), name  # left pad of the prompt part
        assert torch.equal(got[p - p_i : p], want[:p_i]), name  # prompt part ends at P
        assert torch.equal(got[p : p + a_i], want[p_i:]), name  # response part starts at P
        assert (got[p + a_i :] == fill).all(), name  # right pad of the response part
    for name in ACTION_FIELDS:
        got, want = getattr(merged, name)[row], getattr(src, name)[source_row]
        assert_bit_equal(got[:a_i], want, name)
        assert (got[a_i:] == 0).all(), name
    for key in ("high_entropy_mask", "token_pair"):
        got, want = merged.info[key][row], src.info[key][source_row]
        assert_bit_equal(got[:a_i], want, f"info[{key}]")
        assert (got[a_i:] == 0).all(), f"info[{key}]"
    for name in ("reward", "policy_version", "prompt_index"):
        assert_bit_equal(getattr(merged, name)[row], getattr(src, name)[source_row], name)
    for key in ("response_length", "truncated", "reward/reward_model"):
        assert_bit_equal(merged.info[key][row], src.info[key][source_row], f"info[{key}]")
    # Masks: attention is a suffix mask over the prompt columns and a prefix mask over the
    # response columns; the action mask is a prefix mask equal to the latter.
    prompt, response = source.prompts[source_row], source.responses[source_row]
    attention = merged.attention_mask[row]
    assert attention[:p].tolist() == [False] * (p - len(prompt)) + [True] * len(prompt)
    want_actions = [True] * len(response) + [False] * (a - len(response))
    assert attention[p:].tolist() == want_actions
    assert merged.action_mask[row].tolist() == want_actions
    # The alignment invariant: the token at P + j is the row's j-th response token.
    assert [int(merged.sequences[row, p + j]) for j in range(len(response))] == response
    assert merged.sequences[row, p - len(prompt) : p].tolist() == prompt


def _assert_wire_layout(merged: Experience, rows: list[tuple[Batch, int]], pad: int) -> None:
    """The merged masks and tokens are exactly what the server would lay out for these rows."""
    prompts = [src.prompts[i] for src, i in rows]
    responses = [src.responses[i] for src, i in rows]
    sequences, attention_mask, action_mask = wire_layout(prompts, responses, pad)
    assert torch.equal(merged.sequences, sequences)
    assert torch.equal(merged.attention_mask, attention_mask)
    assert torch.equal(merged.action_mask, action_mask)


@pytest.mark.parametrize("pad", [0, 2])
def test_mixing_batches_of_different_widths_keeps_the_wire_layout(pad: int) -> None:
    narrow = build_batch([5, 2], [3, 1], seed=1, pad=pad, version=1)  # P=5, A=3, S=8
    wide = build_batch([1, 2, 1], [7, 4, 0], seed=2, pad=pad, version=2)  # P=2, A=7, S=9
    split = {id(narrow): split_experience_batch(narrow.experience)}
    split[id(wide)] = split_experience_batch(wide.experience)
    order = [(narrow, 0), (wide, 0), (narrow, 1), (wide, 2), (wide, 1)]
    items = [split[id(src)][i] for src, i in order]
    merged = make_experience_batch(items, pad_token_id=pad)
    assert merged.sequences.shape == (5, 12)  # S = P + A with P = 5 (narrow), A = 7 (wide)
    assert (merged.prompt_width, merged.num_actions) == (5, 7)
    for row, (src, i) in enumerate(order):
        _check_row_in_wire_layout(merged, row, src, i, pad)
    assert merged.info["token_pair"].shape == (5, 7, 2)
    assert merged.response_texts == tuple(items[r].response_text for r in range(5))
    _assert_wire_layout(merged, order, pad)
    # The merged batch is an ordinary one: splitting and re-batching it changes nothing.
    assert_same_experience(make_experience_batch(split_experience_batch(merged), pad), merged)


def test_a_wider_prompt_and_a_wider_response_from_different_items_both_widen_the_batch() -> None:
    long_prompt = build_batch([6], [1], seed=3)  # P=6, A=1
    long_response = build_batch([1], [6], seed=4)  # P=1, A=6
    merged = concat_experiences([long_prompt.experience, long_response.experience])
    # S = 12, though each item has S_i = 7: prompts and responses pad independently.
    assert merged.sequences.shape == (2, 12) and merged.prompt_width == 6
    _check_row_in_wire_layout(merged, 0, long_prompt, 0, 0)
    _check_row_in_wire_layout(merged, 1, long_response, 0, 0)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(1, 5), st.integers(0, 5)), min_size=1, max_size=3),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, 3),
    st.integers(0, 2**16),
)
def test_concat_experiences_joins_micro_batches_in_the_wire_layout(
    batch_lengths: list[list[tuple[int, int]]], pad: int, seed: int
) -> None:
    batches = []
    for k, lengths in enumerate(batch_lengths):
        prompt_lens, response_lens = map(list, zip(*lengths, strict=True))
        batches.append(build_batch(prompt_lens, response_lens, seed=seed + k, pad=pad, version=k))
    merged = concat_experiences([b.experience for b in batches], pad_token_id=pad)
    rows = [(b, i) for b in batches for i in range(b.experience.num_rows)]
    assert merged.num_rows == len(rows)
    assert merged.prompt_width == max(b.experience.prompt_width for b in batches)
    assert merged.num_actions == max(b.experience.num_actions for b in batches)
    for row, (src, i) in enumerate(rows):
        _check_row_in_wire_layout(merged, row, src, i, pad)
    items = [item for b in batches for item in split_experience_batch(b.experience)]
    assert_same_experience(merged, make_experience_batch(items, pad_token_id=pad))


def test_concat_of_one_experience_is_that_experience() -> None:
    exp = build_batch([3, 1], [2, 4]).experience
    assert_same_experience(concat_experiences([exp]), exp)
    with pytest.raises(InvalidArgument, match="no experiences"):
        concat_experiences([])


def test_mixing_items_with_and_without_optional_parts_is_refused() -> None:
    full = split_experience_batch(build_batch([2, 3], [2, 2]).experience)
    bare = split_experience_batch(
        build_batch([2, 3], [2, 2], optional=False, texts=False).experience
    )
    with pytest.raises(InvalidArgument, match=r"items\[1\]\.base_action_log_probs"):
        make_experience_batch([full[0], bare[0]])
    fewer_keys = dataclasses.replace(full[1], info={"truncated": full[1].info["truncated"]})
    with pytest.raises(InvalidArgument, match=r"items\[1\]\.info"):
        make_experience_batch([full[0], fewer_keys])
    no_text = dataclasses.replace(full[1], response_text=None)
    with pytest.raises(InvalidArgument, match="response_text"):
        make_experience_batch([full[0], no_text])
    with pytest.raises(InvalidArgument, match="no items"):
        make_experience_batch([])


def test_info_shapes_that_cannot_be_aligned_are_refused() -> None:
    a, b = split_experience_batch(build_batch([2, 3], [2, 2]).experience)
    odd = dataclasses.replace(b, info={**b.info, "reward/reward_model": torch.zeros(3)})
    with pytest.raises(InvalidArgument, match="reward/reward_model"):
        make_experience_batch([a, odd])


def test_an_item_whose_fields_disagree_is_refused() -> None:
    item = split_experience_batch(build_batch([2, 3], [2, 4]).experience)[0]
    with pytest.raises(InvalidArgument, match="buffer_item.kl"):
        dataclasses.replace(item, kl=torch.zeros(3))
    with pytest.raises(InvalidArgument, match="buffer_item.reward"):
        dataclasses.replace(item, reward=torch.zeros(1))


# ------------------------------------------------------------------------------------------
# Devices
# ------------------------------------------------------------------------------------------


def test_to_device_cpu_returns_a_new_equal_experience() -> None:
    exp = build_batch([2, 4], [3, 1]).experience
    moved = exp.to_device("cpu")
    assert moved is not exp
    assert_same_experience(moved, exp)
    assert moved.sequences.device.type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_pin_memory_without_cuda_is_a_no_op() -> None:
    exp = build_batch([2, 4], [3, 1]).experience
    assert exp.pin_memory() is exp


@pytest.mark.gpu
def test_pin_memory_pins_and_to_device_moves_to_cuda() -> None:
    exp = wire_round_trip(build_batch([2, 4, 1], [3, 1, 5]).experience)
    pinned = exp.pin_memory()
    assert pinned is not exp
    for name in EXPERIENCE_TENSOR_FIELDS:
        assert getattr(pinned, name).is_pinned(), name
    assert all(t.is_pinned() for t in pinned.info.values())
    on_gpu = pinned.to_device("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert all(getattr(on_gpu, n).is_cuda for n in EXPERIENCE_TENSOR_FIELDS)
    assert all(t.is_cuda for t in on_gpu.info.values())
    assert_same_experience(on_gpu, exp)
    assert on_gpu.pin_memory() is not None  # pinning CUDA tensors leaves them be
    back = make_experience_batch(split_experience_batch(on_gpu))
    assert back.sequences.is_cuda and back.policy_version.is_cuda
    assert_same_experience(back, exp)
