"""pack=True for "cuda_ipc" (client/weights/packing.py): the tensors copied into one buffer laid
out like the update's data section, kept between updates. The packing itself is device-agnostic
and runs here on CPU tensors; the CUDA IPC send of a packed update (one handle, staged in place
by the server) runs in tests/test_cuda_ipc.py (gpu)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers_weights import tiny_llama
from rollserve.client.weights.flat_weights import flatten_weights
from rollserve.client.weights.packing import PackBuffer
from rollserve.client.weights.update_file import prepare_update


def _data_section(update) -> bytes:  # type: ignore[no-untyped-def]
    _, specs = update.layout()
    return b"".join(
        update.state_dict[s.name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        for s in specs
    )


def _weights(seed: int) -> dict[str, torch.Tensor]:
    weights = {name: t.detach().clone() for name, t in tiny_llama(seed).state_dict().items()}
    weights["model.norm.weight"] = weights["model.norm.weight"].double()  # another itemsize
    weights["scalar"] = torch.tensor(3.5)  # a 0-dim tensor
    weights["empty"] = torch.empty(0, 4)  # no bytes
    return weights


def test_a_packed_update_is_one_run_of_one_buffer_with_the_same_bytes() -> None:
    update = prepare_update(_weights(0), version=1)
    pack = PackBuffer()
    packed = pack.packed(update)
    assert packed.header == update.header and packed.layout() == update.layout()
    _, specs = packed.layout()
    buffer = packed.state_dict[specs[0].name].untyped_storage()
    for spec in specs:
        view = packed.state_dict[spec.name]
        original = update.state_dict[spec.name]
        assert view.shape == original.shape and view.dtype == original.dtype
        assert torch.equal(view, original), spec.name
        if spec.nbytes:  # each at its data-section offset in the one buffer
            assert view.untyped_storage().data_ptr() == buffer.data_ptr()
            assert view.data_ptr() - buffer.data_ptr() == spec.begin
    assert _data_section(packed) == _data_section(update)
    assert pack.allocated_bytes == specs[-1].end


def test_the_buffer_is_reused_then_grown() -> None:
    pack = PackBuffer()
    first = pack.packed(prepare_update(_weights(0), version=1))
    name = next(iter(first.state_dict))
    address = first.state_dict[name].untyped_storage().data_ptr()
    second_update = prepare_update(_weights(1), version=2)
    second = pack.packed(second_update)  # same size: the same buffer, the new values
    assert second.state_dict[name].untyped_storage().data_ptr() == address
    assert _data_section(second) == _data_section(second_update)
    bigger = _weights(2)
    bigger["extra"] = torch.ones(1000)
    third_update = prepare_update(bigger, version=3)
    third = pack.packed(third_update)
    assert pack.allocated_bytes == third_update.layout()[1][-1].end
    assert _data_section(third) == _data_section(third_update)


def test_flattened_weights_are_sent_as_they_are() -> None:
    weights = _weights(0)
    flatten_weights(weights)
    update = prepare_update(weights, version=1)
    pack = PackBuffer()
    assert pack.packed(update) is update  # already one run: nothing to copy
    assert pack.allocated_bytes == 0


@pytest.mark.parametrize("second_device", ["meta"])
def test_tensors_on_two_devices_are_not_packed(second_device: str) -> None:
    # A meta tensor stands in for a second device: prepare_update refuses one (no data to
    # send), so it replaces a checked tensor of the prepared update.
    update = prepare_update({"a": torch.ones(4), "b": torch.ones(4)}, version=1)
    update = dataclasses.replace(
        update, state_dict={"a": torch.ones(4), "b": torch.ones(4, device=second_device)}
    )
    assert PackBuffer().packed(update) is update


def test_a_packed_copy_that_cannot_be_allocated_is_resource_exhausted() -> None:
    from rollserve.client.protocol.errors import ResourceExhausted

    pack = PackBuffer()
    with pytest.raises(ResourceExhausted, match="pack=True: the packed copy"):
        pack._take(torch.device("cpu"), 1 << 62)  # no machine has it
    assert pack.allocated_bytes == 0
