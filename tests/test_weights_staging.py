"""The server's UpdateWeights path (stage, verify, apply) on real tiny Llama models: bit-exact
round trips, and every failure leaves the model's state dict unchanged, bit for bit."""

from __future__ import annotations

import copy
import hashlib
import math
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers_weights import update_in_place, update_weights_requests
from rollserve.client.protocol.errors import FailedPrecondition, InvalidArgument
from rollserve.client.weights.update_file import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    iter_safetensors_bytes,
)
from rollserve.server.weights import staging_arena
from rollserve.v1 import rollout_pb2 as pb
from transformers import LlamaConfig, LlamaForCausalLM

Requests = list[pb.UpdateWeightsRequest]


def state_hash(model: torch.nn.Module) -> str:
    """SHA-256 over every state-dict name and the raw bytes of its tensor."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def assert_state_equal(got: torch.nn.Module | dict, want: torch.nn.Module | dict) -> None:
    got_sd = got.state_dict() if isinstance(got, torch.nn.Module) else got
    want_sd = want.state_dict() if isinstance(want, torch.nn.Module) else want
    assert list(got_sd) == list(want_sd)
    for name in want_sd:
        assert got_sd[name].dtype == want_sd[name].dtype, name
        # Compare bits, not values: NaN != NaN, and -0.0 == 0.0 would hide differences.
        assert torch.equal(got_sd[name].view(torch.uint8), want_sd[name].view(torch.uint8)), name


@pytest.fixture(scope="module")
def actor(tiny_actor_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_actor_dir)


@pytest.fixture()
def receiver(actor: LlamaForCausalLM) -> LlamaForCausalLM:
    return copy.deepcopy(actor)


@pytest.fixture(scope="module")
def sender(actor: LlamaForCausalLM) -> LlamaForCausalLM:
    """The actor one training step later: every parameter moved."""
    model = copy.deepcopy(actor)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    return model


def wide_llama() -> LlamaForCausalLM:
    """A tiny Llama whose 1 MiB embedding and head each span several 256 KiB chunks."""
    torch.manual_seed(2)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def make_requests(
    state_dict: object, *, chunk_bytes: int = MIN_CHUNK_BYTES, **overrides
) -> Requests:
    arguments = {
        "target": "actor",
        "version": 5,
        "mode": "full",
        "chunk_bytes": chunk_bytes,
        **overrides,
    }
    return list(update_weights_requests(state_dict, **arguments))


def cut_requests(header: pb.WeightsHeader, blob: bytes, cuts: list[int]) -> Requests:
    """The header, then blob split at the given byte offsets (chunks of any size), with CRCs."""
    bounds = [0, *cuts, len(blob)]
    chunks = [
        pb.UpdateWeightsRequest(
            chunk=pb.WeightsChunk(offset=a, data=blob[a:b], crc32=zlib.crc32(blob[a:b]))
        )
        for a, b in zip(bounds, bounds[1:], strict=False)
        if b > a
    ]
    return [pb.UpdateWeightsRequest(header=header), *chunks]


def small_chunk_requests(state_dict: object, chunk_bytes: int, **overrides) -> Requests:
    header = make_requests(state_dict, **overrides)[0].header
    blob = b"".join(iter_safetensors_bytes(state_dict, chunk_bytes))
    return cut_requests(header, blob, list(range(chunk_bytes, len(blob), chunk_bytes)))


def blob_of(requests: Requests) -> bytes:
    return b"".join(r.chunk.data for r in requests[1:])


@pytest.mark.parametrize("chunk_bytes", [MIN_CHUNK_BYTES, MAX_CHUNK_BYTES])
@pytest.mark.parametrize("which", ["tiny_actor", "wide"])
def test_full_round_trip_is_bit_exact(
    which: str, chunk_bytes: int, actor: LlamaForCausalLM, sender: LlamaForCausalLM
) -> None:
    if which == "wide":
        sender = wide_llama()
        receiver = wide_llama()
        with torch.no_grad():
            for parameter in receiver.parameters():
                parameter.zero_()
    else:
        receiver = copy.deepcopy(actor)
    requests = make_requests(
        sender, chunk_bytes=chunk_bytes, version=12, target="actor", sha256=True
    )
    before = state_hash(receiver)

    def staged_only() -> None:
        assert state_hash(receiver) == before  # staging never writes the model

    reply = update_in_place(receiver, requests, before_apply=staged_only)
    assert (reply.version, reply.target, reply.transport) == (12, pb.MODEL_ROLE_ACTOR, "grpc")
    assert reply.tensors == len(sender.state_dict())
    assert reply.bytes == requests[0].header.total_bytes == len(blob_of(requests))
    assert_state_equal(receiver, sender)


def test_small_uneven_chunks_round_trip(
    receiver: LlamaForCausalLM, sender: LlamaForCausalLM
) -> None:
    update_in_place(receiver, small_chunk_requests(sender, 4093))
    assert_state_equal(receiver, sender)


def test_a_file_written_by_safetensors_applies(
    receiver: LlamaForCausalLM, sender: LlamaForCausalLM
) -> None:
    blob = safetensors.torch.save(sender.state_dict())
    header = pb.WeightsHeader(
        version=1, total_bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest()
    )
    update_in_place(receiver, cut_requests(header, blob, [100, 5000, 300_000]))
    assert_state_equal(receiver, sender)


def test_float32_update_is_cast_into_a_bfloat16_model(
    actor: LlamaForCausalLM, sender: LlamaForCausalLM
) -> None:
    receiver = copy.deepcopy(actor).to(torch.bfloat16)
    update_in_place(receiver, make_requests(sender))  # staged as sent, cast when applied
    assert_state_equal(receiver, {k: v.to(torch.bfloat16) for k, v in sender.state_dict().items()})


def test_partial_update_changes_only_named_tensors(
    receiver: LlamaForCausalLM, sender: LlamaForCausalLM, actor: LlamaForCausalLM
) -> None:
    names = ["model.norm.weight", "model.layers.1.mlp.up_proj.weight"]
    subset = {n: sender.state_dict()[n] for n in names}
    update_in_place(receiver, make_requests(subset, mode="partial"))
    want = {n: (sender if n in names else actor).state_dict()[n] for n in actor.state_dict()}
    assert_state_equal(receiver, want)


def test_full_update_of_a_tied_model_accepts_either_name() -> None:
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    sender, receiver = LlamaForCausalLM(config), LlamaForCausalLM(config)
    state_dict = sender.state_dict()
    without_head = {
        k: v for k, v in state_dict.items() if k != "lm_head.weight"
    }  # as save_pretrained stores it
    update_in_place(receiver, make_requests(without_head))
    assert_state_equal(receiver, sender)
    assert receiver.lm_head.weight is receiver.model.embed_tokens.weight


# ---- every failure raises InvalidArgument and leaves the model bit for bit as it was ----------


def with_tensor(
    sender: torch.nn.Module, name: str, tensor: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    state_dict = dict(sender.state_dict())
    if tensor is None:
        del state_dict[name]
    else:
        state_dict[name] = tensor
    return state_dict


def recut(requests: Requests, cuts: list[int]) -> Requests:
    return cut_requests(requests[0].header, blob_of(requests), cuts)


def truncated_at(where: Callable[[bytes], int]) -> Callable[[Requests], Requests]:
    def edit(requests: Requests) -> Requests:
        blob = blob_of(requests)
        end = where(blob)
        return cut_requests(
            requests[0].header, blob[:end], [c for c in (4, 20, 1000, 200_000) if c < end]
        )

    return edit


def header_length(blob: bytes) -> int:
    return 8 + int.from_bytes(blob[:8], "little")


def set_header(**fields: object) -> Callable[[Requests], Requests]:
    def edit(requests: Requests) -> Requests:
        header = pb.WeightsHeader()
        header.CopyFrom(requests[0].header)
        for key, value in fields.items():
            if key == "lora":
                header.lora.CopyFrom(value)
            else:
                setattr(header, key, value)
        return [pb.UpdateWeightsRequest(header=header), *requests[1:]]

    return edit


def edit_chunk(index: int, **fields: object) -> Callable[[Requests], Requests]:
    def edit(requests: Requests) -> Requests:
        chunk = pb.WeightsChunk()
        chunk.CopyFrom(requests[index].chunk)
        for key, value in fields.items():
            if value is None:
                chunk.ClearField(key)
            else:
                setattr(chunk, key, value(chunk) if callable(value) else value)
        return [*requests[:index], pb.UpdateWeightsRequest(chunk=chunk), *requests[index + 1 :]]

    return edit


def flip_byte(chunk: pb.WeightsChunk) -> bytes:
    data = bytearray(chunk.data)
    data[len(data) // 2] ^= 0x40
    return bytes(data)


def swap_chunks(requests: Requests) -> Requests:
    return [requests[0], requests[2], requests[1], *requests[3:]]


def poison(value: float) -> Callable[[LlamaForCausalLM], dict[str, torch.Tensor]]:
    def state(sender: LlamaForCausalLM) -> dict[str, torch.Tensor]:
        weight = sender.state_dict()["model.layers.0.self_attn.q_proj.weight"].clone()
        weight[3, 5] = value
        return with_tensor(sender, "model.layers.0.self_attn.q_proj.weight", weight)

    return state


def big_header_prefix(requests: Requests) -> Requests:
    blob = bytearray(blob_of(requests))
    blob[:8] = (1 << 40).to_bytes(8, "little")
    return cut_requests(requests[0].header, bytes(blob), [4096])


Q = "model.layers.0.self_attn.q_proj.weight"
FAILURES: dict[str, tuple[Callable | None, Callable | None, str]] = {
    # name: (state dict from the sender, edit of the request list, expected message)
    "cut_in_length_prefix": (None, truncated_at(lambda b: 5), "ended after 5 of"),
    "cut_in_json_header": (None, truncated_at(lambda b: header_length(b) - 40), "ended after"),
    "cut_inside_a_tensor": (None, truncated_at(lambda b: header_length(b) + 70_001), "ended after"),
    "one_byte_short": (None, truncated_at(lambda b: len(b) - 1), "ended after"),
    "header_only": (None, lambda r: r[:1], "ended after 0 of"),
    "reordered_chunks": (None, swap_chunks, "expected"),
    "duplicated_chunk": (None, lambda r: [*r[:2], r[1], *r[2:]], "each exactly once"),
    "missing_chunk": (None, lambda r: [r[0], r[1], *r[3:]], "in order"),
    "extra_chunk": (
        None,
        lambda r: [*r, edit_chunk(1, offset=len(blob_of(r)))(r)[1]],
        "runs past total_bytes",
    ),
    "bad_crc": (None, edit_chunk(2, crc32=lambda c: (c.crc32 + 1) % 2**32), "crc32 mismatch"),
    "flipped_byte_with_crc": (None, edit_chunk(2, data=flip_byte), "crc32 mismatch"),
    "flipped_byte_without_crc": (None, edit_chunk(2, data=flip_byte, crc32=None), "sha256"),
    "bad_sha256": (None, set_header(sha256="0" * 64), "sha256"),
    "malformed_sha256": (None, set_header(sha256="ABC"), "sha256"),
    "total_bytes_too_small": (
        None,
        lambda r: set_header(total_bytes=r[0].header.total_bytes - 4)(r),
        "cover",
    ),
    "total_bytes_too_large": (
        None,
        lambda r: set_header(total_bytes=r[0].header.total_bytes + 4)(r),
        "cover",
    ),
    "total_bytes_zero": (None, set_header(total_bytes=0), "total_bytes"),
    "unknown_name": (
        lambda s: with_tensor(s, "model.extra.weight", torch.zeros(2)),
        None,
        "unknown tensor name.*model.extra.weight",
    ),
    "missing_name": (
        lambda s: with_tensor(s, "model.norm.weight", None),
        None,
        "misses 1 tensor.*model.norm.weight",
    ),
    "shape_mismatch": (
        lambda s: with_tensor(s, Q, torch.zeros(64, 63)),
        None,
        "shape \\[64, 63\\]",
    ),
    "int_for_float": (
        lambda s: with_tensor(s, Q, torch.zeros(64, 64, dtype=torch.int32)),
        None,
        "integer/bool",
    ),
    "nan": (poison(math.nan), None, "NaN or infinite"),
    "inf": (poison(-math.inf), None, "NaN or infinite"),
    "header_over_limit": (None, big_header_prefix, "over the limit"),
    "manifest_shape": (
        None,
        lambda r: edit_manifest(r, "shape"),
        "manifest does not match.*differ",
    ),
    "manifest_extra": (
        None,
        lambda r: edit_manifest(r, "extra"),
        "manifest does not match.*model.ghost",
    ),
    "lora_in_full_mode": (None, set_header(lora=pb.LoraAdapter(rank=2, alpha=1.0)), "only allowed"),
    "lora_mode_without_lora": (None, set_header(mode=pb.UPDATE_MODE_LORA), "required"),
    "unknown_mode": (None, set_header(mode=7), "mode"),
    "second_header": (None, lambda r: [r[0], r[1], r[0], *r[2:]], "second header"),
    "chunk_first": (None, lambda r: r[1:], "first UpdateWeights message must be a header"),
    "empty_stream": (None, lambda r: [], "must be a header"),
    "empty_message": (None, lambda r: [*r[:2], pb.UpdateWeightsRequest(), *r[2:]], "empty message"),
    "empty_chunk": (
        None,
        lambda r: [*r[:2], edit_chunk(2, data=b"", crc32=0)(r)[2], *r[2:]],
        "empty chunk",
    ),
}


def edit_manifest(requests: Requests, case: str) -> Requests:
    header = pb.WeightsHeader()
    header.CopyFrom(requests[0].header)
    if case == "shape":
        header.manifest[0].shape[0] += 1
    else:
        header.manifest.add(name="model.ghost", dtype=pb.DTYPE_FLOAT32, shape=[1])
    return [pb.UpdateWeightsRequest(header=header), *requests[1:]]


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_failures_raise_and_leave_the_model_untouched(
    case: str, receiver: LlamaForCausalLM, sender: LlamaForCausalLM
) -> None:
    make_state, edit, match = FAILURES[case]
    state_dict = make_state(sender) if make_state else sender
    requests = make_requests(state_dict, sha256=True)
    requests = recut(requests, [1000, 100_000, 200_000, 300_000])  # enough chunks to reorder
    if edit is not None:
        requests = edit(requests)
    before = state_hash(receiver)
    with pytest.raises(InvalidArgument, match=match):
        update_in_place(receiver, requests, max_header_bytes=1 << 20)
    assert state_hash(receiver) == before


def test_a_header_over_a_small_limit_is_refused(
    receiver: LlamaForCausalLM, sender: LlamaForCausalLM
) -> None:
    with pytest.raises(InvalidArgument, match="over the limit of 64"):
        update_in_place(receiver, make_requests(sender), max_header_bytes=64)


def test_non_finite_values_are_applied_when_allowed(
    receiver: LlamaForCausalLM, sender: LlamaForCausalLM
) -> None:
    state_dict = poison(math.nan)(sender)
    update_in_place(receiver, make_requests(state_dict, allow_non_finite=True))
    assert_state_equal(receiver, state_dict)
    assert torch.isnan(receiver.state_dict()[Q][3, 5])


def test_an_iterator_error_propagates_and_nothing_is_applied(
    receiver: LlamaForCausalLM, sender: LlamaForCausalLM
) -> None:
    class ClientCancelled(Exception):
        pass

    def cancelled_midway() -> Iterator[pb.UpdateWeightsRequest]:
        requests = make_requests(sender)
        yield from requests[:2]
        raise ClientCancelled

    before = state_hash(receiver)
    with pytest.raises(ClientCancelled):
        update_in_place(receiver, cancelled_midway())
    assert state_hash(receiver) == before


class WithBuffers(torch.nn.Module):
    """A module with an integer and a bool buffer next to a float16 weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4, 3, dtype=torch.float16))
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False]))


@pytest.mark.parametrize(
    ("name", "tensor", "match"),
    [
        ("steps", torch.arange(5, dtype=torch.int32), "must equal"),
        ("steps", torch.arange(5, dtype=torch.float32), "floating tensor"),
        ("mask", torch.tensor([1, 0], dtype=torch.uint8), "must equal"),
        ("weight", torch.full((4, 3), 70_000.0), "beyond the model dtype's largest finite value"),
        ("weight", torch.ones(4, 3, dtype=torch.int64), "integer/bool"),
    ],
)
def test_dtype_rules(name: str, tensor: torch.Tensor, match: str) -> None:
    model = WithBuffers()
    before = state_hash(model)
    with pytest.raises(InvalidArgument, match=match):
        update_in_place(model, make_requests({name: tensor}, mode="partial"))
    assert state_hash(model) == before


def test_allowed_dtype_conversions_apply() -> None:
    model = WithBuffers()
    update = {
        "weight": torch.full((4, 3), 0.5, dtype=torch.float64),
        "steps": torch.tensor([9, 8, 7, 6, 5]),
        "mask": torch.tensor([False, True]),
    }
    update_in_place(model, make_requests(update))
    assert model.weight.dtype == torch.float16 and torch.equal(
        model.weight, torch.full((4, 3), 0.5, dtype=torch.float16)
    )
    assert model.steps.tolist() == [9, 8, 7, 6, 5] and model.mask.tolist() == [False, True]


def test_a_bool_tensor_with_a_byte_other_than_0_or_1_is_refused() -> None:
    model = WithBuffers()
    requests = make_requests({"mask": torch.tensor([True, True])}, mode="partial", crc32=False)
    blob = blob_of(requests)[:-1] + b"\x02"  # the data section is the last 2 bytes
    with pytest.raises(InvalidArgument, match="0 and 1"):
        update_in_place(model, cut_requests(requests[0].header, blob, []))


def test_apply_refuses_a_model_that_changed_after_staging(
    receiver: LlamaForCausalLM, sender: LlamaForCausalLM
) -> None:
    changed: list[str] = []

    def change_the_model() -> None:  # between staging and apply: another shape, the same name
        receiver.model.norm.weight = torch.nn.Parameter(torch.zeros(3))
        changed.append(state_hash(receiver))

    with pytest.raises(FailedPrecondition, match="changed"):
        update_in_place(receiver, make_requests(sender), before_apply=change_the_model)
    assert [state_hash(receiver)] == changed  # nothing was written


@pytest.mark.gpu
def test_cuda_sender_and_cuda_bfloat16_receiver(
    actor: LlamaForCausalLM, sender: LlamaForCausalLM
) -> None:
    on_device = {k: v.cuda() for k, v in sender.state_dict().items()}
    on_device[Q] = sender.state_dict()[Q].T.contiguous().cuda().T  # a non-contiguous device view
    receiver = copy.deepcopy(actor).to("cuda", torch.bfloat16)
    where = {k: v.data_ptr() for k, v in receiver.state_dict().items()}
    # The arena the update path leases: a CUDA model stages on its device, through a ring of
    # page-locked host slots (weights/pipeline.py).
    arena = staging_arena(receiver)
    assert arena.pin_memory and arena.device is not None and arena.device.type == "cuda"
    update_in_place(receiver, make_requests(on_device))
    assert arena.staged_on_device
    want = {k: v.to(torch.bfloat16) for k, v in sender.state_dict().items()}
    assert_state_equal({k: v.cpu() for k, v in receiver.state_dict().items()}, want)
    assert {k: v.data_ptr() for k, v in receiver.state_dict().items()} == where


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_value_checks_take_large_finite_values_and_refuse_nan_and_infinity(dtype) -> None:
    from rollserve.client.protocol.errors import InvalidArgument
    from rollserve.server.weights.verify import ValueRule, check_values

    rule = ValueRule(check_finite=True)
    largest = torch.finfo(dtype).max
    # Finite, but their sum overflows: the one-pass sum check must fall back to the exact one.
    check_values("big", torch.full((1024,), largest, dtype=dtype), rule)
    check_values("mixed", torch.tensor([largest, -largest, 1.0, 0.0], dtype=dtype), rule)
    # Finite, but their squares overflow (the fast check is a sum of squares).
    check_values("squares", torch.full((64,), math.sqrt(largest) * 4, dtype=dtype), rule)
    for bad in (float("nan"), float("inf"), float("-inf")):
        values = torch.zeros(4096, dtype=dtype)
        values[4095] = bad
        with pytest.raises(InvalidArgument, match="NaN or infinite"):
            check_values("bad", values, rule)


def test_copy_all_is_copy_into_each_destination_with_casts() -> None:
    """staging.copy_all (a device arena's apply: one multi-tensor copy) writes every pair as
    destination.copy_(source) would: same-dtype pairs, casts, a strided destination, and
    never rebinds a destination's storage."""
    from rollserve.server.weights.copy_runs import copy_all

    g = torch.Generator().manual_seed(0)
    wide = torch.zeros(6, 8)
    destinations = [torch.zeros(5, 3), torch.zeros(7, dtype=torch.bfloat16), wide[:, ::2]]
    sources = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g), torch.randn(6, 4)]
    addresses = [d.data_ptr() for d in destinations]
    copy_all(list(zip(destinations, sources, strict=True)))
    assert torch.equal(destinations[0], sources[0])
    assert torch.equal(destinations[1], sources[1].to(torch.bfloat16))
    assert torch.equal(wide[:, ::2], sources[2]) and not wide[:, 1::2].any()
    assert [d.data_ptr() for d in destinations] == addresses
    copy_all([])  # nothing to copy
