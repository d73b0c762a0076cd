"""An update's apply finds the model's tensors by name (server/weights/spec.py `live_tensors`):
what `state_dict(keep_vars=True)` holds under those names, as the model is at that moment (a
parameter or a module replaced or deleted since the last update), or None when the state dict
is not plainly the modules' tensors (then apply reads the state dict itself)."""

from __future__ import annotations

import torch
from helpers_weights import in_place_updates, perturbed, tiny_llama
from rollserve.server.weights.arena import StagingArena, set_staging_arena
from rollserve.server.weights.pipeline import SlotRing
from rollserve.server.weights.spec import live_tensors
from test_weights_staging import make_requests
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

Q = "model.layers.0.self_attn.q_proj.weight"


def tiny_qwen2(cls: type = Qwen2ForCausalLM) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, num_labels=1)  # fmt: skip
    return cls(config)


def test_the_tensors_are_the_state_dicts_under_every_name() -> None:
    for model in (tiny_llama(1), tiny_qwen2(), tiny_qwen2(Qwen2ForTokenClassification)):
        state = model.state_dict(keep_vars=True)
        found = live_tensors(model, list(state))
        assert found is not None and list(found) == list(state)
        assert all(found[name] is tensor for name, tensor in state.items())
    # Tied: both names are the one Parameter, as in the state dict.
    tied = live_tensors(tiny_qwen2(), ["lm_head.weight", "model.embed_tokens.weight"])
    assert tied is not None and tied["lm_head.weight"] is tied["model.embed_tokens.weight"]


def test_names_the_state_dict_lacks_are_left_out() -> None:
    model = tiny_qwen2()
    assert "model.rotary_emb.inv_freq" in dict(model.named_buffers())  # not persistent
    names = ["model.rotary_emb.inv_freq", "model.nothing.weight", "model.norm.bias", Q]
    assert list(live_tensors(model, names) or {}) == [Q]


def test_what_changed_since_the_last_call_is_found_as_it_is_now() -> None:
    model = tiny_llama(1)
    names = list(model.state_dict())
    live_tensors(model, names)
    attention = model.model.layers[0].self_attn
    attention.q_proj.weight = torch.nn.Parameter(torch.zeros_like(attention.q_proj.weight))
    assert live_tensors(model, names)[Q] is attention.q_proj.weight  # type: ignore[index]
    attention.q_proj = torch.nn.Linear(64, 64, bias=False)  # a module replaced
    assert live_tensors(model, names)[Q] is attention.q_proj.weight  # type: ignore[index]
    del model.model.layers[1]  # a module deleted: its names are gone, as from the state dict
    found = live_tensors(model, names)
    assert found is not None and list(found) == list(model.state_dict())


class Renamed(torch.nn.Module):
    """A module whose state_dict renames its keys (no hook): not plain either."""

    def __init__(self) -> None:
        super().__init__()
        self.p0 = torch.nn.Parameter(torch.zeros(2))

    def state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        return {"renamed": self.p0}


def test_a_state_dict_hook_or_override_sends_apply_to_the_state_dict() -> None:
    model = tiny_llama(1)
    assert live_tensors(model, [Q]) is not None
    model = tiny_llama(1)
    model.model.norm.register_state_dict_post_hook(lambda *args: None)
    assert live_tensors(model, [Q]) is None
    assert live_tensors(Renamed(), ["renamed"]) is None
    wrapper = torch.nn.Sequential(Renamed())
    assert live_tensors(wrapper, ["0.p0"]) is None


def test_an_update_writes_the_parameters_the_model_holds_now() -> None:
    """Through a real update staged on a ("cpu") device arena, whose apply resolves its targets
    with live_tensors: a projection replaced after the first update receives the second."""
    sender, model = tiny_llama(1), tiny_llama(2)
    ring = SlotRing(pin_memory=False, slots=3, slot_bytes=4093)
    set_staging_arena(model, StagingArena(device="cpu", ring=ring))
    updates = in_place_updates(model)
    updates.update(iter(make_requests(sender, version=1)))
    model.model.layers[0].self_attn.q_proj = torch.nn.Linear(64, 64, bias=False)
    moved = perturbed(sender, seed=3)
    updates.update(iter(make_requests(moved, version=2)))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, moved[name]), name
