"""The models one server hosts: actor, reference, critic and reward model.

Every model goes through `from_pretrained(..., local_files_only=True)`: never a hub download, and
the built-in tiny default is saved to a temporary directory first so it takes the same path as a
production checkpoint. Models are loaded in eval mode with gradients off; they are only scored.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ...client.protocol.dtypes import TORCH_NAMES as _DTYPES
from ...client.protocol.roles import ROLES
from ..config import ServerConfig
from .default_model import BUILTIN_SOURCE, save_tiny_causal_lm
from .memory import own_memory

# "0": a model on a GPU takes `module.to(device)`'s allocation per tensor instead of one buffer
# in the update file's order (memory.py), for comparing the two.
FLAT_WEIGHTS_ENV = "ROLLSERVE_FLAT_WEIGHTS"

__all__ = [
    "ROLES",
    "ModelLoadError",
    "LoadedModel",
    "ModelSet",
    "check_model_dirs",
    "load_models",
    "resolve_device",
    "resolve_dtype",
]

_LOG = logging.getLogger(__name__)

# Config attributes that hold a context length, in the order architectures tend to use them.
_CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


class ModelLoadError(RuntimeError):
    """A model directory that cannot be used; the message says which role and why."""


@dataclass(frozen=True)
class LoadedModel:
    """One loaded model and what Health reports about it."""

    role: str
    module: torch.nn.Module
    source: str  # the directory, or "builtin:<name>"
    architecture: str  # e.g. "LlamaForCausalLM"
    dtype: str  # e.g. "float32"
    num_parameters: int


@dataclass(frozen=True)
class ModelSet:
    """Everything `load_models` produced: the models by role plus the actor's tokenizer."""

    actor: LoadedModel
    tokenizer: Any  # transformers.PreTrainedTokenizerBase of the actor
    reference: LoadedModel | None
    critic: LoadedModel | None
    reward: LoadedModel | None
    device: torch.device
    device_label: str  # e.g. "cpu", "cuda:0 (NVIDIA H100)"
    vocab_size: int
    max_context_tokens: int

    def loaded(self) -> list[LoadedModel]:
        """The loaded models in ROLES order."""
        candidates = (self.actor, self.reference, self.critic, self.reward)
        return [model for model in candidates if model is not None]


def resolve_device(name: str) -> torch.device:
    """The torch device: cuda for "auto" when a GPU is visible, else cpu; others as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype: for "auto", bfloat16 on a GPU and float32 elsewhere (CPU bf16 is slow)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def check_model_dirs(config: ServerConfig) -> None:
    """Fail fast, before binding a port, on directories that do not exist or hold no config."""
    for role, directory in _configured_dirs(config).items():
        path = Path(directory)
        if not path.is_dir():
            raise ModelLoadError(f"{role} model directory does not exist: {directory}")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{role} model directory has no config.json: {directory}")


def load_models(config: ServerConfig) -> ModelSet:
    """Load every model the config names onto its device, in eval mode with gradients off."""
    check_model_dirs(config)
    _quiet_transformers()
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    actor, tokenizer = _load_actor(config.actor, device, dtype)
    if config.reference is None:
        # The initial actor's weights: later actor updates must not move the reference.
        reference = replace(actor, role="reference", module=copy.deepcopy(actor.module))
    else:
        reference = _load(config.reference, "reference", "causal_lm", device, dtype)
    critic = _optional(config.critic, "critic", "token_classification", device, dtype)
    reward = _optional(config.reward_model, "reward", "sequence_classification", device, dtype)
    vocab_size = int(actor.module.config.vocab_size)
    for head in (reference, critic, reward):
        _check_vocab(head, vocab_size)
    return ModelSet(
        actor=actor,
        tokenizer=tokenizer,
        reference=reference,
        critic=critic,
        reward=reward,
        device=device,
        device_label=_device_label(device),
        vocab_size=vocab_size,
        max_context_tokens=_max_context_tokens(actor.module.config, tokenizer),
    )


def _configured_dirs(config: ServerConfig) -> dict[str, str]:
    dirs = {
        "actor": config.actor,
        "reference": config.reference,
        "critic": config.critic,
        "reward": config.reward_model,
    }
    return {role: directory for role, directory in dirs.items() if directory is not None}


def _load_actor(directory: str | None, device: torch.device, dtype: torch.dtype):
    if directory is not None:
        return _load(directory, "actor", "causal_lm", device, dtype), _load_tokenizer(directory)
    with tempfile.TemporaryDirectory(prefix="rollserve-tiny-") as tmp:
        save_tiny_causal_lm(tmp)
        actor = _load(tmp, "actor", "causal_lm", device, dtype, source=BUILTIN_SOURCE)
        return actor, _load_tokenizer(tmp)


def _optional(directory: str | None, role: str, kind: str, device, dtype) -> LoadedModel | None:
    return None if directory is None else _load(directory, role, kind, device, dtype)


def _load(
    directory: str,
    role: str,
    kind: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    source: str | None = None,
) -> LoadedModel:
    """from_pretrained with the Auto class for `kind`; any missing weight is an error."""
    import transformers

    auto_class = {
        "causal_lm": transformers.AutoModelForCausalLM,
        "token_classification": transformers.AutoModelForTokenClassification,
        "sequence_classification": transformers.AutoModelForSequenceClassification,
    }[kind]
    try:
        module, info = auto_class.from_pretrained(
            directory, dtype=dtype, local_files_only=True, output_loading_info=True
        )
    except Exception as exc:  # transformers raises many types (OSError, ValueError, KeyError...)
        raise ModelLoadError(f"cannot load {role} model from {directory}: {exc}") from exc
    # A checkpoint of another kind loads "successfully" with a randomly initialised head; a
    # critic or reward model with random weights would silently poison training.
    if info["missing_keys"]:
        missing = ", ".join(sorted(info["missing_keys"])[:5])
        kind_name = auto_class.__name__.removeprefix("AutoModelFor")
        raise ModelLoadError(
            f"{role} model in {directory} is not a {kind_name} checkpoint: weights missing"
            f" ({missing})"
        )
    if kind != "causal_lm" and module.config.num_labels != 1:
        raise ModelLoadError(
            f"{role} model in {directory} must have num_labels=1, has {module.config.num_labels}"
        )
    if device.type == "cpu" or os.environ.get(FLAT_WEIGHTS_ENV, "").strip() != "0":
        # memory.py: one private buffer in the update file's order (on the CPU handed to the
        # staging arena; on a GPU an update is then one copy into it)
        own_memory(module, device)
    module = module.to(device).eval().requires_grad_(False)  # what own_memory left: in place
    return LoadedModel(
        role=role,
        module=module,
        source=source or str(directory),
        architecture=type(module).__name__,
        dtype=str(dtype).removeprefix("torch."),
        num_parameters=sum(p.numel() for p in module.parameters()),
    )


def _load_tokenizer(directory: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the actor's tokenizer from {directory}: {exc}") from exc
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        # Batched generation needs a pad id; the EOS token is the usual stand-in (never a target,
        # since masks, not ids, decide which positions count).
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _check_vocab(model: LoadedModel | None, actor_vocab_size: int) -> None:
    # The server feeds the actor's token ids to every model, so every embedding must cover them.
    if model is None:
        return
    vocab_size = int(getattr(model.module.config, "vocab_size", 0) or 0)
    if vocab_size < actor_vocab_size:
        raise ModelLoadError(
            f"{model.role} model {model.source} has vocab_size {vocab_size}, smaller than the"
            f" actor's {actor_vocab_size}: they must share the actor's tokenizer"
        )


def _max_context_tokens(model_config: Any, tokenizer: Any) -> int:
    for attr in _CONTEXT_ATTRS:
        value = getattr(model_config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    # Tokenizers without a limit report a huge sentinel (1e30); treat that as unknown.
    limit = getattr(tokenizer, "model_max_length", 0)
    return int(limit) if 0 < limit < 1 << 31 else 0


def _device_label(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def _quiet_transformers() -> None:
    # Progress bars and load reports are noise in a server log (and we check missing keys).
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
