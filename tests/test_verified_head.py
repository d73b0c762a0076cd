"""A repeated head: an update whose safetensors head is byte for byte the last one's reuses its
parse, its plan, its device check groups and its staged views (stream.py, VerifiedHead), and
still checks every value; a new head is checked anew; a model changed under a remembered head
is caught before anything is written, and the next update checks its head again."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from helpers_weights import (
    in_place_updates,
    perturbed,
    state_hash,
    tiny_llama,
    update_weights_requests,
)
from rollserve.client.protocol.errors import FailedPrecondition, InvalidArgument
from rollserve.server.weights import WeightUpdates, staging_arena
from rollserve.server.weights.arena import StagingArena, set_staging_arena
from rollserve.server.weights.pipeline import SlotRing
from torch.multiprocessing.reductions import StorageWeakRef
from transformers import LlamaForCausalLM

Q = "model.layers.0.self_attn.q_proj.weight"
UP = "model.layers.1.mlp.up_proj.weight"  # in the middle of the file


def receiver_with(arena: str) -> LlamaForCausalLM:
    """A model staging in host memory ("host": a full update is adopted) or through the
    pipelined arena a CUDA server uses, here on the CPU ("pipelined": copied, checked per
    group)."""
    model = tiny_llama(2)
    if arena == "pipelined":
        ring = SlotRing(pin_memory=False, slots=3, slot_bytes=4093)
        set_staging_arena(model, StagingArena(device="cpu", ring=ring))
    return model


def updated_once(arena: str) -> tuple[LlamaForCausalLM, LlamaForCausalLM, WeightUpdates]:
    """A sender, a receiver staging in `arena` that took the sender's weights as version 1,
    and the receiver's updater (versions rise from there)."""
    sender, receiver = tiny_llama(1), receiver_with(arena)
    updates = in_place_updates(receiver)
    updates.update(iter(requests(sender, 1)))
    return sender, receiver, updates


def requests(state: object, version: int, **options: object) -> list:
    return list(update_weights_requests(state, version=version, **options))


def equal_bits(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    live = model.state_dict()
    return all(torch.equal(live[name].view(torch.uint8), t.view(torch.uint8))
               for name, t in state.items())  # fmt: skip


@pytest.mark.parametrize("arena", ["host", "pipelined"])
def test_a_repeated_head_is_reused_and_still_checks_every_value(arena: str) -> None:
    sender, receiver, updates = updated_once(arena)
    head = staging_arena(receiver).verified_head
    assert head is not None
    moved = perturbed(sender, seed=3)
    updates.update(iter(requests(moved, 2)))
    assert staging_arena(receiver).verified_head is head  # not parsed or planned again
    assert equal_bits(receiver, moved)
    if arena == "pipelined":  # one buffer, kept: the staged views were made once
        assert len(head.views) == 1

    # The same head with a NaN in a middle tensor: refused by its name, nothing written.
    bad = perturbed(sender, seed=4)
    bad[UP].view(-1)[77] = math.nan
    before = state_hash(receiver)
    with pytest.raises(InvalidArgument, match=f"^{UP}: NaN or infinite"):
        updates.update(iter(requests(bad, 3)))
    assert state_hash(receiver) == before
    # A value beyond float16 from float32: a head of other dtypes is checked anew and kept.
    receiver.half()
    staging_arena(receiver).forget_head()  # a cast model: what a server never does
    huge = {name: t.half().float() for name, t in moved.items()}
    huge[UP].view(-1)[5] = 1e6
    with pytest.raises(InvalidArgument, match=f"^{UP}: value 1e\\+06 is beyond"):
        updates.update(iter(requests(huge, 3)))
    assert staging_arena(receiver).verified_head is not head


@pytest.mark.parametrize("arena", ["host", "pipelined"])
def test_another_head_is_checked_anew_and_remembered(arena: str) -> None:
    sender, receiver, updates = updated_once(arena)
    full = staging_arena(receiver).verified_head
    partial = {Q: sender.state_dict()[Q] * 2}
    updates.update(iter(requests(partial, 2, mode="partial")))
    second = staging_arena(receiver).verified_head
    assert second is not full and second is not None
    assert [e.name for e in second.entries] == [Q]
    assert torch.equal(receiver.state_dict()[Q], partial[Q])
    # The same tensors under another mode: the plan differs (a full update must cover the
    # model), so the head is checked again and refused.
    with pytest.raises(InvalidArgument, match="full update misses"):
        updates.update(iter(requests(partial, 3, mode="full")))
    assert torch.equal(receiver.state_dict()[Q], partial[Q])


def test_a_model_changed_under_a_remembered_head_is_caught_then_checked_anew() -> None:
    sender, receiver, updates = updated_once("pipelined")
    receiver.to(torch.bfloat16)  # the remembered plan says float32 targets
    before = state_hash(receiver)
    moved = perturbed(sender, seed=5)
    with pytest.raises(FailedPrecondition, match="changed after the update was staged"):
        updates.update(iter(requests(moved, 2)))
    assert state_hash(receiver) == before
    assert staging_arena(receiver).verified_head is None  # forgotten
    updates.update(iter(requests(moved, 2)))  # checked against the bfloat16 model: a cast
    assert torch.equal(receiver.state_dict()[Q], moved[Q].to(torch.bfloat16))


def test_the_views_of_a_buffer_the_arena_let_go_are_dropped_with_it() -> None:
    """The kept views hold their buffer: when a larger update grows the arena, the old buffer
    must be freed all the same (one staging copy at a time, arena.py's bound)."""
    sender, receiver = tiny_llama(1), receiver_with("pipelined")
    updates = in_place_updates(receiver)
    updates.update(iter(requests({Q: sender.state_dict()[Q]}, 1, mode="partial")))
    views = next(iter(staging_arena(receiver).verified_head.views.values()))
    small = StorageWeakRef(views[Q].untyped_storage())
    del views
    updates.update(iter(requests(sender, 2)))  # the whole model: the arena grows
    gc.collect()
    assert small.expired()
    arena = staging_arena(receiver)
    assert arena.capacity_bytes >= sum(t.nbytes for t in sender.state_dict().values())
    arena.release()
    assert not arena.verified_head.views


@pytest.mark.parametrize("arena", ["host", "pipelined"])
def test_the_same_head_under_another_manifest_is_checked_anew(arena: str) -> None:
    """The manifest is part of what a head is matched by (UpdateOptions.manifest_key): a header
    whose manifest no longer describes the same head bytes is refused, not waved through on
    the remembered check; no manifest at all is a head checked anew and taken."""
    sender, receiver, updates = updated_once(arena)
    head = staging_arena(receiver).verified_head
    moved = perturbed(sender, seed=5)
    wrong = requests(moved, 2)
    wrong[0].header.manifest[0].shape[0] += 1  # the first message holds the header
    before = state_hash(receiver)
    with pytest.raises(InvalidArgument, match="manifest"):
        updates.update(iter(wrong))
    assert state_hash(receiver) == before
    updates.update(iter(requests(moved, 2, manifest=False)))
    assert equal_bits(receiver, moved)
    assert staging_arena(receiver).verified_head is not head
