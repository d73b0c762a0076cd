"""LoRA updates on real tiny models: W = W_base + alpha / r * B @ A, absolute and replacing."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import pytest
import torch
from helpers_weights import in_place_updates, update_weights_requests
from rollserve.client.protocol.errors import InvalidArgument
from rollserve.server.weights import LoraState
from rollserve.server.weights.lora import merged_weight
from rollserve.v1 import rollout_pb2 as pb
from transformers import LlamaForCausalLM
from transformers.pytorch_utils import Conv1D

PREFIX = "base_model.model."
RANK = 4
ALPHA = 8.0


def state_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def adapter(
    model: torch.nn.Module, modules: list[str], *, seed: int, rank: int = RANK, prefix: str = PREFIX
) -> dict[str, torch.Tensor]:
    """A PEFT-named adapter with random (non-zero) A and B for each module's (out, in) weight."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module in modules:
        out_features, in_features = model.get_submodule(module).weight.shape
        tensors[f"{prefix}{module}.lora_A.weight"] = torch.randn(
            rank, in_features, generator=generator
        )
        tensors[f"{prefix}{module}.lora_B.weight"] = (
            torch.randn(out_features, rank, generator=generator) * 0.1
        )
    return tensors


class Receiver:
    """A model behind the server's update path (a test's own updater); each send is the next
    version, and `bases` are the LoRA bases the updater keeps for the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.updates = in_place_updates(model)
        self.version = 0

    @property
    def bases(self) -> LoraState:
        return self.updates.lora["actor"]

    def send(self, tensors: dict[str, torch.Tensor], **header: object) -> None:
        self.version += 1
        requests = update_weights_requests(tensors, target="actor", version=self.version, **header)
        self.updates.update(iter(requests))


def send_lora(
    receiver: Receiver,
    tensors: dict[str, torch.Tensor],
    *,
    rank: int = RANK,
    alpha: float = ALPHA,
    fan_in_fan_out: bool = False,
) -> None:
    lora = pb.LoraAdapter(rank=rank, alpha=alpha, fan_in_fan_out=fan_in_fan_out)
    receiver.send(tensors, mode="lora", lora=lora)


def expected(
    base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, transpose: bool = False
) -> torch.Tensor:
    """The merge in float64, as an independent reference."""
    delta = (ALPHA / RANK) * (b.double() @ a.double())
    return base.double() + (delta.T if transpose else delta)


@pytest.fixture(scope="module")
def actor(tiny_actor_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_actor_dir)


Q0, V1 = "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_is_base_plus_scaled_b_a(actor: LlamaForCausalLM, dtype: torch.dtype) -> None:
    model = copy.deepcopy(actor).to(dtype)
    receiver = Receiver(model)
    base = weights_of(model)
    tensors = adapter(model, [Q0, V1], seed=0)
    send_lora(receiver, tensors)
    after = weights_of(model)
    for module in (Q0, V1):
        a, b = (
            tensors[f"{PREFIX}{module}.lora_A.weight"],
            tensors[f"{PREFIX}{module}.lora_B.weight"],
        )
        got = after[f"{module}.weight"]
        # Bit-exact against the documented float32 recipe, and close to a float64 reference.
        assert torch.equal(
            got,
            merged_weight(base[f"{module}.weight"], a, b, scale=ALPHA / RANK, fan_in_fan_out=False),
        )
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(
            got.double(), expected(base[f"{module}.weight"], a, b), rtol=tolerance, atol=tolerance
        )
        assert not torch.equal(got, base[f"{module}.weight"])
    untouched = [n for n in base if n not in (f"{Q0}.weight", f"{V1}.weight")]
    assert all(torch.equal(after[n], base[n]) for n in untouched)


def test_the_same_adapter_twice_is_idempotent(actor: LlamaForCausalLM) -> None:
    model = copy.deepcopy(actor)
    receiver = Receiver(model)
    tensors = adapter(model, [Q0, V1], seed=0)
    send_lora(receiver, tensors)
    once = state_hash(model)
    send_lora(receiver, tensors)
    assert state_hash(model) == once
    assert receiver.bases.names() == {f"{Q0}.weight", f"{V1}.weight"}


def test_a_second_adapter_replaces_the_first(actor: LlamaForCausalLM) -> None:
    model = copy.deepcopy(actor)
    receiver = Receiver(model)
    base = weights_of(model)
    send_lora(receiver, adapter(model, [Q0, V1], seed=0))
    second = adapter(model, [Q0], seed=1, prefix="")  # names without the PEFT prefix work too
    send_lora(receiver, second)
    after = weights_of(model)
    want_q = merged_weight(
        base[f"{Q0}.weight"],
        second[f"{Q0}.lora_A.weight"],
        second[f"{Q0}.lora_B.weight"],
        scale=ALPHA / RANK,
        fan_in_fan_out=False,
    )
    assert torch.equal(after[f"{Q0}.weight"], want_q)  # from the base, not on top of adapter 1
    assert torch.equal(after[f"{V1}.weight"], base[f"{V1}.weight"])  # adapter 2 leaves v_proj alone
    assert receiver.bases.names() == {f"{Q0}.weight"}


def test_a_partial_update_resets_the_base_of_what_it_writes(actor: LlamaForCausalLM) -> None:
    model = copy.deepcopy(actor)
    receiver = Receiver(model)
    tensors = adapter(model, [Q0], seed=0)
    send_lora(receiver, tensors)
    new_base = torch.full_like(model.get_submodule(Q0).weight, 0.25)
    receiver.send({f"{Q0}.weight": new_base}, mode="partial")
    assert torch.equal(model.get_submodule(Q0).weight, new_base) and len(receiver.bases) == 0
    send_lora(receiver, tensors)  # now merges onto the new base
    want = merged_weight(
        new_base,
        tensors[f"{PREFIX}{Q0}.lora_A.weight"],
        tensors[f"{PREFIX}{Q0}.lora_B.weight"],
        scale=ALPHA / RANK,
        fan_in_fan_out=False,
    )
    assert torch.equal(model.get_submodule(Q0).weight, want)


class GPT2Block(torch.nn.Module):
    """transformers' Conv1D stores its weight (in, out): the fan_in_fan_out case."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c_attn = Conv1D(nf=24, nx=8)  # weight (8, 24)
        torch.nn.init.normal_(self.c_attn.weight)


def test_fan_in_fan_out_transposes_the_delta() -> None:
    model = GPT2Block()
    receiver = Receiver(model)
    base = model.c_attn.weight.detach().clone()  # (in 8, out 24)
    generator = torch.Generator().manual_seed(3)
    a, b = torch.randn(RANK, 8, generator=generator), torch.randn(24, RANK, generator=generator)
    send_lora(receiver, {"c_attn.lora_A.weight": a, "c_attn.lora_B.weight": b}, fan_in_fan_out=True)
    torch.testing.assert_close(
        model.c_attn.weight.double(), expected(base, a, b, transpose=True), rtol=1e-5, atol=1e-5
    )
    # The merged layer computes what PEFT's unmerged LoRA computes: x W + b + s * x A^T B^T.
    x = torch.randn(5, 8, generator=generator)
    unmerged = x @ base + model.c_attn.bias + (ALPHA / RANK) * (x @ a.T @ b.T)
    torch.testing.assert_close(model.c_attn(x), unmerged, rtol=1e-5, atol=1e-5)


def test_fan_in_fan_out_shapes_are_checked() -> None:
    model = GPT2Block()
    receiver = Receiver(model)
    a, b = torch.randn(RANK, 8), torch.randn(24, RANK)
    with pytest.raises(InvalidArgument, match="lora_A.weight: shape"):
        send_lora(
            receiver,
            {"c_attn.lora_A.weight": a, "c_attn.lora_B.weight": b},
            fan_in_fan_out=False,
        )


def mutilate(tensors: dict[str, torch.Tensor], case: str) -> dict[str, torch.Tensor]:
    tensors = dict(tensors)
    if case == "missing_b":
        del tensors[f"{PREFIX}{V1}.lora_B.weight"]
    elif case == "unknown_module":
        tensors[f"{PREFIX}model.layers.0.self_attn.nope.lora_A.weight"] = torch.zeros(RANK, 64)
    elif case == "not_a_factor":
        tensors[f"{PREFIX}{Q0}.weight"] = torch.zeros(64, 64)
    elif case == "integer_factor":
        tensors[f"{PREFIX}{Q0}.lora_A.weight"] = torch.zeros(RANK, 64, dtype=torch.int32)
    elif case == "duplicate_factor":
        tensors[f"{Q0}.lora_A.weight"] = tensors[f"{PREFIX}{Q0}.lora_A.weight"]
    elif case == "nan":
        tensors[f"{PREFIX}{Q0}.lora_B.weight"] = tensors[f"{PREFIX}{Q0}.lora_B.weight"].clone()
        tensors[f"{PREFIX}{Q0}.lora_B.weight"][0, 0] = float("nan")
    return tensors


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("missing_b", f"factor\\(s\\) missing: {V1}.lora_B.weight"),
        ("unknown_module", "not LoRA factors"),
        ("not_a_factor", "not LoRA factors"),
        ("integer_factor", "must be floating"),
        ("duplicate_factor", "two lora_A"),
        ("nan", "NaN"),
    ],
)
def test_bad_adapters_are_refused_and_change_nothing(
    actor: LlamaForCausalLM, case: str, match: str
) -> None:
    model = copy.deepcopy(actor)
    receiver = Receiver(model)
    send_lora(receiver, adapter(model, [Q0], seed=5))  # an adapter already merged
    before = state_hash(model)
    with pytest.raises(InvalidArgument, match=match):
        send_lora(receiver, mutilate(adapter(model, [Q0, V1], seed=0), case))
    assert state_hash(model) == before and receiver.bases.names() == {f"{Q0}.weight"}


def test_the_rank_must_match_the_header(actor: LlamaForCausalLM) -> None:
    model = copy.deepcopy(actor)
    receiver = Receiver(model)
    before = state_hash(model)
    with pytest.raises(InvalidArgument, match="rank 4"):
        send_lora(receiver, adapter(model, [Q0], seed=0, rank=8), rank=4)
    with pytest.raises(InvalidArgument, match="rank must be positive"):
        send_lora(receiver, adapter(model, [Q0], seed=0), rank=0)
    assert state_hash(model) == before
