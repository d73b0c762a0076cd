"""An update applied as one copy: the weights laid out in the update file's order.

Three parts meet here: the file order (client/protocol/file_order.py: a module's weights
before its biases, so q/k/v and gate/up are neighbours), a model's weights in one buffer in that
order (server/models/memory.own_memory, what a GPU server loads into) and the apply's merged
runs (server/weights/copy_runs.py). A trainer that flattened its weights (flat_weights.py) hands
over a data section that continues where the model's parameters continue, so the apply is one
copy however many tensors the file holds; a device arena keeps file offsets, so an update staged
there is one copy too. The engine's fused projections of such a model are views of the buffer.

Everything runs on the CPU: the model is loaded as a server loads it (from_pretrained, then
own_memory: on the CPU always, on a GPU unless ROLLSERVE_FLAT_WEIGHTS=0), and the stager runs its
device path with a "device" arena on the CPU (as tests/test_in_place_staging.py does).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers_weights import perturbed, stand_in_for_cuda
from rollserve.client.protocol.file_order import file_order
from rollserve.client.weights.cuda_ipc import export_cuda_ipc
from rollserve.client.weights.flat_weights import flatten_weights
from rollserve.client.weights.update_file import prepare_update
from rollserve.server.config import ServerConfig
from rollserve.server.generation import fused as fused_module
from rollserve.server.models import load_models
from rollserve.server.weights import UpdateStager
from rollserve.server.weights.arena import StagingArena
from rollserve.server.weights.pipeline import SlotRing

VOCAB = 128


def _saved_qwen2(directory: Path, *, tied: bool) -> Path:
    """A tiny Qwen2 (q/k/v biases: the case whose state-dict order interleaves weights and
    biases), saved; every tensor's size a multiple of 64 bytes in float32."""
    import transformers as tf

    config = tf.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(3)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def _loaded(directory: Path) -> torch.nn.Module:
    models = load_models(ServerConfig(device="cpu", actor=str(directory), dtype="float32"))
    return models.actor.module


def _arena() -> StagingArena:
    """A pipelined ("device") arena on the CPU: the stager's device path."""
    return StagingArena(device="cpu", ring=SlotRing(pin_memory=False, slots=3, slot_bytes=4093))


def _apply(
    model: torch.nn.Module, weights: dict[str, torch.Tensor], *, in_place: bool
) -> tuple[int, int]:
    """Stage `weights` (from their own memory in place when they are one run of it, else fed
    into a device arena) and apply; (copies the apply issued, tensors in the file)."""
    update = prepare_update(weights, version=1)
    head, specs = update.layout()
    stager = UpdateStager(update.header, model, None, arena=_arena())
    lane = stager.lane(0, stager.options.total_bytes)
    if in_place:
        first = weights[specs[0].name]
        run = torch.empty(0, dtype=torch.uint8).set_(
            first.untyped_storage(), first.storage_offset() * first.element_size(),
            (specs[-1].end,),
        )  # fmt: skip
        stager.offer_in_place(run.device, run.storage_offset(), None)
        lane.feed(0, head)
        assert lane.file_data.in_place
        lane.place(run)
    else:
        lane.feed(0, head)
        data = torch.cat([weights[s.name].reshape(-1).view(torch.uint8) for s in specs])
        lane.feed_tensor(len(head), data)
    staged = stager.finish()
    assert staged.on_device
    staged.apply(model)
    assert staged.timings is not None
    return staged.timings.counts["apply_launch"], len(specs)


def test_the_file_order_puts_what_the_engine_fuses_side_by_side() -> None:
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.bias",
        "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.v_proj.bias",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.bias",
        "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.bias",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight", "model.norm.weight",
        "lm_head.weight", "lm_head.bias", "scale",
    ]  # fmt: skip
    entries = [(name, torch.bfloat16, (2,)) for name in names]
    entries.insert(3, ("model.layers.0.self_attn.rotary", torch.float32, (2,)))  # wider: first
    ordered = [name for name, _, _ in file_order(entries)]
    assert sorted(ordered) == sorted(n for n, _, _ in entries)
    assert ordered[0] == "model.layers.0.self_attn.rotary"
    attn = "model.layers.0.self_attn."
    mlp = "model.layers.0.mlp."
    assert ordered[1:17] == [
        "model.embed_tokens.weight",
        attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight",
        attn + "o_proj.weight", attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias",
        mlp + "gate_proj.weight", mlp + "up_proj.weight", mlp + "down_proj.weight",
        mlp + "gate_proj.bias", mlp + "up_proj.bias",
        "model.layers.0.input_layernorm.weight", "model.norm.weight", "lm_head.weight",
    ]  # fmt: skip
    # Names of fewer than three parts are tensors of their own: never moved past a neighbour.
    assert ordered[17:] == ["lm_head.bias", "scale"]


def test_a_loaded_model_lies_in_one_buffer_in_the_file_order(tmp_path: Path) -> None:
    directory = _saved_qwen2(tmp_path, tied=True)
    import transformers as tf

    reference = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    model = _loaded(directory)
    state = model.state_dict(keep_vars=True)
    storages = {tensor.untyped_storage().data_ptr() for tensor in state.values()}
    assert len(storages) == 1
    entries = [(name, t.dtype, tuple(t.shape)) for name, t in state.items()]
    distinct: dict[int, torch.Tensor] = {}
    for name, _, _ in file_order(entries):
        distinct.setdefault(id(state[name]), state[name])
    assert len(distinct) == len(state) - 1  # the tied embedding: one place for both names
    addresses = [tensor.data_ptr() for tensor in distinct.values()]
    sizes = [tensor.nbytes for tensor in distinct.values()]
    # Back to back in the file's order (every size here is a multiple of the alignment).
    assert all(b == a + n for a, b, n in zip(addresses, addresses[1:], sizes, strict=False))
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_the_fused_projections_of_a_loaded_model_are_views_of_its_buffer(
    tmp_path: Path,
) -> None:
    model = _loaded(_saved_qwen2(tmp_path, tied=False))
    layer = model.model.layers[0]
    buffer = layer.self_attn.q_proj.weight.untyped_storage().data_ptr()
    for parts in (
        (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
        (layer.mlp.gate_proj, layer.mlp.up_proj),
    ):
        before = [part.weight.data_ptr() for part in parts]
        fused = fused_module.fuse(parts)
        assert fused is not None
        weight, bias = fused.linear
        assert weight.untyped_storage().data_ptr() == buffer  # no copy made for the GEMM
        assert weight.data_ptr() == before[0]
        assert [part.weight.data_ptr() for part in parts] == before  # nothing moved
        if bias is not None:
            assert bias.untyped_storage().data_ptr() == buffer


@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "device arena"])
def test_an_update_of_flattened_weights_is_one_copy(tmp_path: Path, in_place: bool) -> None:
    model = _loaded(_saved_qwen2(tmp_path, tied=False))
    weights = perturbed(model, seed=1)
    flatten_weights(weights)  # the trainer's side: its weights laid out like the data section
    pointers = {name: t.data_ptr() for name, t in model.state_dict().items()}
    copies, tensors = _apply(model, weights, in_place=in_place)
    assert tensors > 20
    assert copies == 1
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    assert {name: t.data_ptr() for name, t in model.state_dict().items()} == pointers


@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "device arena"])
def test_a_tied_weight_sent_under_both_names_is_written_once(
    tmp_path: Path, in_place: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer's state dict holds a tied tensor under both names; flattened, the tensor sits
    at its first name's place and the other name's bytes are a shadow the cuda_ipc export
    refreshes, so the data section is one run (staged in place). The shared parameter is
    written once, by the last name's pair: two copies, never one per tensor."""
    model = _loaded(_saved_qwen2(tmp_path, tied=True))
    weights = perturbed(model, seed=2)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # one tensor, two names
    flatten_weights(weights)
    with torch.no_grad():
        weights["model.embed_tokens.weight"].add_(1.0)  # a step after flattening
    stand_in_for_cuda(monkeypatch)
    export_cuda_ipc(prepare_update(weights, version=1))  # the client's part: the shadow now
    copies, tensors = _apply(model, weights, in_place=in_place)
    assert copies == 2 < tensors
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def test_weights_in_allocations_of_their_own_take_a_copy_each(tmp_path: Path) -> None:
    """The comparison: a model whose parameters are allocations of their own (what
    `module.to(device)` makes, ROLLSERVE_FLAT_WEIGHTS=0) applies a copy per tensor."""
    model = _loaded(_saved_qwen2(tmp_path, tied=False))
    for tensor in model.state_dict(keep_vars=True).values():
        tensor.data = tensor.data.clone()
    weights = perturbed(model, seed=3)
    flatten_weights(weights)
    copies, tensors = _apply(model, weights, in_place=True)
    assert copies == tensors
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def test_odd_tensors_keep_their_values_and_places_in_the_buffer() -> None:
    """A scalar, an empty tensor, integer and bool buffers, a non-persistent buffer and sizes
    that are not multiples of the alignment: every state-dict tensor keeps its value in the one
    buffer (padded where needed); the non-persistent buffer gets memory of its own."""
    from rollserve.server.models.memory import own_memory

    module = torch.nn.Module()
    module.scale = torch.nn.Parameter(torch.tensor(2.5))
    module.empty = torch.nn.Parameter(torch.zeros(0, 3))
    module.odd = torch.nn.Parameter(torch.arange(7, dtype=torch.bfloat16))
    module.register_buffer("steps", torch.tensor([3, 4], dtype=torch.int64))
    module.register_buffer("mask", torch.tensor([True, False, True]))
    module.register_buffer("cache", torch.ones(5), persistent=False)
    before = {name: t.clone() for name, t in module.state_dict().items()}
    cache = module.cache
    own_memory(module)
    after = module.state_dict(keep_vars=True)
    assert set(after) == set(before)
    for name, tensor in after.items():
        assert tensor.dtype == before[name].dtype and torch.equal(tensor, before[name]), name
    filled = [t for t in after.values() if t.numel()]
    assert len({t.untyped_storage().data_ptr() for t in filled}) == 1
    assert all(t.data_ptr() % 64 == filled[0].data_ptr() % 64 for t in filled)  # aligned alike
    assert torch.equal(module.cache, torch.ones(5))
    assert module.cache.untyped_storage().data_ptr() != filled[0].untyped_storage().data_ptr()
    assert module.cache is cache  # the same tensor object, its data its own
