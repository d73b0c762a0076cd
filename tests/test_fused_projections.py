"""Fused projections (server/generation/fused.py): each layer's q/k/v and gate/up as one GEMM
over a concatenated weight whose row blocks the HF modules' parameters become.

Tiny Llama (no biases), Qwen2 (q/k/v biases) and Qwen3 (q/k norms) configs, built, saved and
loaded in float32 on the CPU. The fused forward must equal the HF forward; writes into the
modules' parameters (every update on a device) must reach the fused weights; a parameter rebound
elsewhere (the CPU adoption of an update) is copied back into its block at the next batch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from rollserve.server.experience.generation import SamplingParams, generate
from rollserve.server.experience.generation import left_pad as pad_prompts
from rollserve.server.experience.scoring import position_ids_from_mask
from rollserve.server.generation import fused as fused_module
from rollserve.server.generation.families import read_family
from rollserve.server.generation.model import Forward
from rollserve.server.generation.rotary import RopeTable

VOCAB = 64
PAD = 0


def _model(name: str, directory: Path) -> torch.nn.Module:
    import transformers as tf

    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=None, eos_token_id=None, pad_token_id=PAD,
    )  # fmt: skip
    configs = {
        "llama": lambda: tf.LlamaConfig(**common),
        "qwen2": lambda: tf.Qwen2Config(**common),
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=8),
    }
    torch.manual_seed(len(name))
    built = tf.AutoModelForCausalLM.from_config(configs[name]())
    with torch.no_grad():  # random biases and norm weights, so that reading them matters
        for param_name, tensor in built.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                tensor.add_(torch.randn_like(tensor) * 0.2)
    built.generation_config.eos_token_id = None
    built.save_pretrained(directory)
    return tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def _fused_forward(model: torch.nn.Module) -> Forward:
    family = read_family(model)
    assert family is not None
    with torch.inference_mode():  # as a request builds it: the weights must stay updatable
        return Forward(family, RopeTable(family.rotary, family.max_positions, torch.float32),
                       fused=True)  # fmt: skip


def _rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left pads
    mask[2, -2:] = 0  # right pads (scoring's layout)
    return ids.masked_fill(mask == 0, PAD), mask, position_ids_from_mask(mask)


def _agree(model: torch.nn.Module, forward: Forward) -> None:
    ids, mask, positions = _rows()
    with torch.inference_mode():
        theirs = model.model(input_ids=ids, attention_mask=mask, position_ids=positions)
        mine = forward.hidden_states(ids, mask, positions)
    real = mask.bool()
    torch.testing.assert_close(mine[real], theirs.last_hidden_state[real], atol=1e-5, rtol=1e-5)


def _blocks_of_one_storage(parts: list[torch.Tensor]) -> bool:
    storage = parts[0].untyped_storage().data_ptr()
    position = parts[0].data_ptr()
    for part in parts:
        if part.untyped_storage().data_ptr() != storage or part.data_ptr() != position:
            return False
        position += part.numel() * part.element_size()
    return True


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_the_fused_forward_equals_hf_over_views_of_the_fused_weights(
    name: str, tmp_path: Path
) -> None:
    model = _model(name, tmp_path)
    forward = _fused_forward(model)
    assert forward.fused_projections == 2 * len(model.model.layers)
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        qkv = [attention.q_proj, attention.k_proj, attention.v_proj]
        assert _blocks_of_one_storage([p.weight for p in qkv])
        assert _blocks_of_one_storage([mlp.gate_proj.weight, mlp.up_proj.weight])
        if name == "qwen2":
            assert _blocks_of_one_storage([p.bias for p in qkv])
        assert isinstance(attention.q_proj.weight, torch.nn.Parameter)
        assert not attention.q_proj.weight.is_inference()
    _agree(model, forward)


def test_writes_into_the_parameters_reach_the_fused_weights(tmp_path: Path) -> None:
    """What an update on a device and a LoRA merge do: copy into the existing storage."""
    model = _model("qwen2", tmp_path)
    forward = _fused_forward(model)
    addresses = [p.data_ptr() for p in model.parameters()]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.copy_(torch.randn_like(layer.self_attn.k_proj.weight))
            layer.self_attn.v_proj.bias.add_(0.5)
            layer.mlp.up_proj.weight.mul_(1.5)
    assert not forward.refresh_fused()  # nothing was rebound
    assert [p.data_ptr() for p in model.parameters()] == addresses
    _agree(model, forward)


def test_a_rebound_parameter_is_copied_back_into_its_block(tmp_path: Path) -> None:
    """The CPU adoption of an update rebinds parameters (`param.data = staged`): the next batch
    copies their values into the fused weights, at the addresses graphs were captured on."""
    model = _model("qwen2", tmp_path)
    forward = _fused_forward(model)
    layer = model.model.layers[1]
    addresses = [p.data_ptr() for p in model.parameters()]
    with torch.no_grad():
        layer.self_attn.q_proj.weight.data = torch.randn_like(layer.self_attn.q_proj.weight)
        layer.self_attn.q_proj.bias.data = torch.randn_like(layer.self_attn.q_proj.bias)
        layer.mlp.gate_proj.weight.data = torch.randn_like(layer.mlp.gate_proj.weight)
    rebound = layer.self_attn.q_proj.weight.detach().clone()
    _agree(model, forward)  # hidden_states refreshes first
    assert [p.data_ptr() for p in model.parameters()] == addresses
    assert torch.equal(layer.self_attn.q_proj.weight, rebound)
    assert not forward.refresh_fused()  # repaired once
    # A parameter moved to another dtype gets a new fused tensor: no copy across dtypes.
    with torch.no_grad():
        layer.mlp.up_proj.weight.data = layer.mlp.up_proj.weight.double()
        layer.mlp.gate_proj.weight.data = layer.mlp.gate_proj.weight.double()
    assert forward.refresh_fused()
    assert layer.mlp.gate_proj.weight.dtype == torch.float64
    assert _blocks_of_one_storage([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])


def test_a_second_forward_reuses_the_fused_weights(tmp_path: Path) -> None:
    """The engine's and the registry's scoring forward of one model fuse once: the second finds
    the blocks already joined and moves nothing."""
    model = _model("llama", tmp_path)
    _fused_forward(model)
    addresses = [p.data_ptr() for p in model.parameters()]
    second = _fused_forward(model)
    assert [p.data_ptr() for p in model.parameters()] == addresses
    assert second.fused_projections == 2 * len(model.model.layers)
    _agree(model, second)


def test_projections_that_cannot_be_one_gemm_stay_apart() -> None:
    plain = torch.nn.Linear(8, 4)
    assert fused_module.fuse((plain, torch.nn.Linear(8, 4, bias=False))) is None  # bias on one
    assert fused_module.fuse((plain, torch.nn.Linear(6, 4))) is None  # another input
    assert fused_module.fuse((plain, torch.nn.Linear(8, 4).double())) is None  # another dtype
    joined = fused_module.fuse((plain, torch.nn.Linear(8, 2)))
    assert joined is not None and joined.sizes == (4, 2)


def test_the_switch_and_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(fused_module.FUSE_ENV, raising=False)
    assert not fused_module.fuses_by_default(cpu) and fused_module.fuses_by_default(cuda)
    monkeypatch.setenv(fused_module.FUSE_ENV, "0")
    assert not fused_module.fuses_by_default(cuda)
    monkeypatch.setenv(fused_module.FUSE_ENV, "1")
    assert fused_module.fuses_by_default(cpu)


def test_the_engine_generates_hf_tokens_on_fused_weights_across_updates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ROLLSERVE_FUSED_PROJECTIONS=1 on the CPU: the engine's greedy tokens equal HF generate's
    before and after an in-place update and after a rebinding one (the CPU adoption)."""
    monkeypatch.setenv(fused_module.FUSE_ENV, "1")
    model = _model("qwen2", tmp_path)
    prompts = [[5, 6, 7, 8], [20, 21], [30, 31, 32, 33, 34, 35]]
    ids, mask = pad_prompts(prompts, PAD, torch.device("cpu"))
    params = SamplingParams(max_new_tokens=12, temperature=0.0)

    def ours_equal_hf() -> torch.Tensor:
        out = generate(model, prompts, params, pad_token_id=PAD,
                       generator=torch.Generator().manual_seed(0), path="rollserve")  # fmt: skip
        with torch.inference_mode():
            theirs = model.generate(
                input_ids=ids, attention_mask=mask.long(), do_sample=False, pad_token_id=PAD,
                max_new_tokens=12, eos_token_id=None,
            )  # fmt: skip
        assert torch.equal(out.sequences, theirs)
        return out.sequences

    before = ours_equal_hf()
    from rollserve.server.generation import engine_for

    engine = engine_for(model, "rollserve")
    assert engine is not None and engine.forward.fused_projections == 4
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.copy_(torch.randn_like(tensor) * 0.5)
    copied = ours_equal_hf()
    assert not torch.equal(copied, before)
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.data = torch.randn_like(tensor) * 0.5
    ours_equal_hf()


def _matmuls(call: Callable[[], object]) -> int:
    """The matrix products `call` runs: aten linear (what F.linear dispatches to under
    inference mode), mm and addmm (what it decomposes to otherwise)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten

    class Count(TorchDispatchMode):
        products = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func.overloadpacket in (aten.linear, aten.mm, aten.addmm):
                Count.products += 1
            return func(*args, **(kwargs or {}))

    with Count():
        call()
    return Count.products


@pytest.mark.parametrize("fused", [False, True])
def test_a_fused_layer_runs_four_matrix_products(fused: bool, tmp_path: Path) -> None:
    """What fusing is for: a layer's q/k/v and gate/up are one product each (4 per layer with
    o and down, where the HF layout runs 7); the numbers alone cannot tell the two apart.
    Eager, the MLP runs in one chunk a call (model.MLP_CALL_CHUNKS is for compiled calls)."""
    model = _model("qwen2", tmp_path)
    family = read_family(model)
    assert family is not None
    rope = RopeTable(family.rotary, family.max_positions, torch.float32)
    forward = Forward(family, rope, fused=fused)
    ids, mask, positions = _rows()
    with torch.inference_mode():
        products = _matmuls(lambda: forward.hidden_states(ids, mask, positions))
    assert products == len(family.layers) * (4 if fused else 7)
