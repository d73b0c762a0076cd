"""flatten_weights / data_section_run: a trainer's weights as one run laid out like the data
section, which WeightsGroup broadcasts in plain slices (DistributedSource.contiguous)."""

from __future__ import annotations

import pytest
import torch
from rollserve.client.protocol.errors import InvalidArgument
from rollserve.client.weights.flat_weights import (
    Shadow,
    data_section_run,
    flatten_weights,
    shadows_of,
)
from rollserve.client.weights.update_file import safetensors_header


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.Linear(16, 32), torch.nn.LayerNorm(32)
    ).to(torch.float32)


def _run(state_dict: dict[str, torch.Tensor]) -> torch.Tensor | None:
    _, specs = safetensors_header(state_dict)
    sources = [state_dict[spec.name].detach().reshape(-1).view(torch.uint8) for spec in specs]
    return data_section_run(sources, specs, specs[-1].end)


def test_a_flattened_module_is_one_run_and_keeps_training() -> None:
    module = _module()
    before = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    parameters = list(module.parameters())
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    assert _run(module.state_dict()) is None  # separate allocations
    flatten_weights(module)
    state_dict = module.state_dict()
    for name, tensor in state_dict.items():
        assert torch.equal(tensor, before[name])
    assert list(module.parameters()) == parameters  # the same Parameters, moved
    run = _run(state_dict)
    assert run is not None
    _, specs = safetensors_header(state_dict)
    for spec in specs:  # the run is the data section of the update file, byte for byte
        expected = state_dict[spec.name].reshape(-1).view(torch.uint8)
        assert torch.equal(run[spec.begin : spec.end], expected)
    # The optimizer writes into the run: the next update sends the new values without a copy.
    # The loss reads the output through fixed random weights: a plain .sum() of a LayerNorm's
    # output gives everything before the norm a zero gradient (normalised values sum to zero),
    # and rounding then decides whether SGD moves those weights at all.
    readout = torch.randn(32, generator=torch.Generator().manual_seed(1))
    (module(torch.tensor([1, 2])) * readout).sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in parameters)
    optimizer.step()
    trained = module.state_dict()
    for spec in specs:
        assert not torch.equal(trained[spec.name], before[spec.name]), spec.name
        expected = trained[spec.name].reshape(-1).view(torch.uint8)
        assert torch.equal(run[spec.begin : spec.end], expected), spec.name


def test_a_tensor_moved_out_breaks_the_run_and_a_tied_one_is_its_shadow() -> None:
    module = _module()
    flatten_weights(module)
    assert _run(module.state_dict()) is not None
    module[1].bias.data = module[1].bias.data.clone()  # lives elsewhere now
    assert _run(module.state_dict()) is None
    shared = torch.ones(8)
    tied = {"a": shared, "b": shared, "c": torch.zeros(4)}
    flatten_weights(tied)  # one tensor at two offsets: the second a shadow of the first
    assert torch.equal(tied["a"], torch.ones(8)) and torch.equal(tied["c"], torch.zeros(4))
    shared.mul_(5.0)  # a step: the shadow is refreshed when the run is asked for
    run = _run(tied)
    assert run is not None
    assert torch.equal(run.view(torch.float32), torch.tensor([5.0] * 16 + [0.0] * 4))
    tied["b"] = torch.ones(8)  # a tied name that no longer is: other memory, no run
    assert _run(tied) is None


def test_a_tied_tensor_lives_at_its_first_name_and_shadows_the_others() -> None:
    """One tensor under two names (and another view of the same memory under a third): it
    moves to its first name's offset; the other names' offsets hold a copy, remembered as
    shadows of the buffer (cuda_ipc's export refreshes them; tests/test_cuda_ipc.py)."""
    shared = torch.arange(8.0)
    tied = {"a.weight": shared, "b.weight": shared, "c.weight": shared.detach(), "d": torch.ones(4)}
    flatten_weights(tied)
    _, specs = safetensors_header(tied)
    begin = {spec.name: spec.begin for spec in specs}
    storage = tied["d"].untyped_storage()
    base = storage.data_ptr()
    assert shared.data_ptr() - base == begin["a.weight"]
    assert tied["c.weight"].data_ptr() == shared.data_ptr()  # the other view moved there too
    shadows = shadows_of(storage)
    assert set(shadows) == {"b.weight", "c.weight"}
    assert shadows["b.weight"] == Shadow(begin["b.weight"], begin["a.weight"], 32)
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
    for name in ("b.weight", "c.weight"):
        place = raw[shadows[name].begin : shadows[name].begin + 32].view(torch.float32)
        assert torch.equal(place, torch.arange(8.0))  # filled once, at flattening
    assert shadows_of(torch.ones(2).untyped_storage()) == {}


def test_tensors_on_two_devices_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="devices"):
        flatten_weights({"a": torch.ones(2), "b": torch.ones(2, device="meta")})
    flatten_weights({})  # nothing to do
