"""Which Hugging Face architectures the engine runs, and where their parameters live.

The engine reads the loaded HF module's own submodules (Linear, RMSNorm, Embedding) at every
forward: no copies, so weight updates, LoRA merges and teacher-forced scoring see one set of
weights. A model outside the list, or a config the engine does not implement, gets None and
keeps the Hugging Face generation path.

Scoring reads the decoder body alone (`read_body`): any model whose base model is one of the
supported decoder bodies (a causal LM, or a critic's or reward model's *ForTokenClassification /
*ForSequenceClassification) runs its body on the engine's forward and keeps its own head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_BODIES",
    "Family",
    "Layer",
    "body_unsupported_reason",
    "read_body",
    "read_family",
    "unsupported_reason",
]

# The Llama family: pre-norm decoder, RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.
# Qwen2 adds q/k/v biases (read from the Linear modules), Qwen3 per-head q/k RMSNorm,
# Mistral (and Qwen with use_sliding_window) a sliding attention window.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)
# Their decoder bodies (the base model under `base_model_prefix`), which scoring also runs for
# the classification heads built on them.
SUPPORTED_BODIES = ("LlamaModel", "Qwen2Model", "Qwen3Model", "MistralModel")

# Rotary types whose cos/sin at a position depend on the sequence length: one table built
# up front would differ from what the HF forward computes for shorter sequences.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class Layer:
    """One decoder layer's modules (the HF module's own) and its attention window."""

    input_norm: torch.nn.Module
    q_proj: torch.nn.Linear
    k_proj: torch.nn.Linear
    v_proj: torch.nn.Linear
    o_proj: torch.nn.Linear
    q_norm: torch.nn.Module | None  # Qwen3: RMSNorm over each head before RoPE
    k_norm: torch.nn.Module | None
    post_norm: torch.nn.Module
    gate_proj: torch.nn.Linear
    up_proj: torch.nn.Linear
    down_proj: torch.nn.Linear
    window: int | None  # sliding window in columns, None = full attention


@dataclass(frozen=True)
class Family:
    """A supported model, seen as the tensors the engine's forward reads."""

    architecture: str
    embed: torch.nn.Embedding
    layers: tuple[Layer, ...]
    norm: torch.nn.Module
    lm_head: torch.nn.Linear | None  # None: a decoder body read for scoring (read_body)
    rotary: torch.nn.Module  # the HF rotary embedding module (builds the cos/sin table)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    max_positions: int
    vocab: int


def _windows(config: object, layers: int) -> list[int | None]:
    """Each layer's sliding window (None: full), as HF's masks apply them."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window is None:
        return [None] * layers
    if types is None:  # Mistral: one window for every layer
        return [int(window)] * layers
    return [int(window) if t == "sliding_attention" else None for t in types]


def _backbone(model: torch.nn.Module) -> torch.nn.Module | None:
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    return backbone if isinstance(backbone, torch.nn.Module) else None


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the engine cannot generate with `model` (None: it can)."""
    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        return f"architecture {name} is not in the engine's list"
    return body_unsupported_reason(model)


def body_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the engine's forward cannot run the decoder body of `model` (None: it can)."""
    backbone = _backbone(model)
    if backbone is None or type(backbone).__name__ not in SUPPORTED_BODIES:
        body = type(backbone).__name__ if backbone is not None else "none"
        return f"decoder body {body} of {type(model).__name__} is not in the engine's list"
    config = getattr(model, "config", None)
    if config is None:
        return f"{type(model).__name__} has no config"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the engine implements SwiGLU with silu)"
    rotary = getattr(backbone, "rotary_emb", None)
    rope_type = getattr(rotary, "rope_type", None)
    if not isinstance(rope_type, str):
        return "rotary embedding with per-layer types"
    if any(kind in rope_type for kind in _LENGTH_DEPENDENT_ROPE):
        return f"rope type {rope_type!r} depends on the sequence length"
    for module in model.modules():
        # Quantized or adapter-wrapped projections compute something else than F.linear.
        if isinstance(module, torch.nn.Linear) and type(module) is not torch.nn.Linear:
            return f"projection of type {type(module).__name__}"
    layer = backbone.layers[0]
    for norm in (layer.input_layernorm, backbone.norm):
        if not hasattr(norm, "variance_epsilon"):
            return f"norm of type {type(norm).__name__}"
    if type(layer.mlp.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
        return f"activation {type(layer.mlp.act_fn).__name__}"
    return None


def read_family(model: torch.nn.Module) -> Family | None:
    """The engine's view of `model` for generation, or None when unsupported_reason gives a
    reason."""
    if unsupported_reason(model) is not None:
        return None
    return _read(model, model.lm_head)


def read_body(model: torch.nn.Module) -> Family | None:
    """The engine's view of `model`'s decoder body (no lm_head: the caller applies the
    model's own head), or None when body_unsupported_reason gives a reason."""
    if body_unsupported_reason(model) is not None:
        return None
    return _read(model, None)


def _read(model: torch.nn.Module, lm_head: torch.nn.Linear | None) -> Family:
    config, backbone = model.config, _backbone(model)
    windows = _windows(config, len(backbone.layers))
    layers = tuple(
        Layer(
            input_norm=layer.input_layernorm,
            q_proj=layer.self_attn.q_proj,
            k_proj=layer.self_attn.k_proj,
            v_proj=layer.self_attn.v_proj,
            o_proj=layer.self_attn.o_proj,
            q_norm=getattr(layer.self_attn, "q_norm", None),
            k_norm=getattr(layer.self_attn, "k_norm", None),
            post_norm=layer.post_attention_layernorm,
            gate_proj=layer.mlp.gate_proj,
            up_proj=layer.mlp.up_proj,
            down_proj=layer.mlp.down_proj,
            window=window,
        )
        for layer, window in zip(backbone.layers, windows, strict=True)
    )
    attention = backbone.layers[0].self_attn
    head_dim = int(attention.head_dim)
    return Family(
        architecture=type(model).__name__,
        embed=backbone.embed_tokens,
        layers=layers,
        norm=backbone.norm,
        lm_head=lm_head,
        rotary=backbone.rotary_emb,
        num_heads=attention.q_proj.out_features // head_dim,
        num_kv_heads=attention.k_proj.out_features // head_dim,
        head_dim=head_dim,
        scaling=float(attention.scaling),
        max_positions=int(config.max_position_embeddings),
        vocab=backbone.embed_tokens.num_embeddings,
    )
