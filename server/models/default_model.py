"""The built-in default model: a tiny random Llama-style causal LM and a byte-level tokenizer.

Built in-process (no download), saved to a directory and loaded back through the real
`from_pretrained` path, so the service starts anywhere in seconds and tests exercise the same
loading code as production models. The tokenizer is byte-level BPE with no merges: every UTF-8
string is encodable and decodes back exactly, with a vocabulary of 3 specials + 256 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
BUILTIN_SOURCE = "builtin:tiny-llama"

# A minimal chat template so apply_chat_template works on the default model.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of a tiny Llama. The defaults build in well under a second on a CPU."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    seed: int = 0


def build_byte_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """A byte-level tokenizer: ids 0..2 are <pad>, <s>, </s>; ids 3..258 are the 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD_TOKEN: 0, BOS_TOKEN: 1, EOS_TOKEN: 2}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting, so a token is exactly one byte.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _llama_config(vocab_size: int, spec: TinyModelSpec, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **extra,
    )


def save_tiny_causal_lm(directory: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Build a random tiny LlamaForCausalLM + tokenizer and save both to `directory`."""
    from transformers import LlamaForCausalLM

    directory = Path(directory)
    tokenizer = build_byte_tokenizer()
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(_llama_config(len(tokenizer), spec))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_tiny_scalar_head(
    directory: str | Path, kind: str, spec: TinyModelSpec = TinyModelSpec()
) -> Path:
    """Build a tiny one-label Llama head model and save it with the tokenizer.

    kind="critic": LlamaForTokenClassification (a value per token);
    kind="reward": LlamaForSequenceClassification (a score read at the last real token).
    """
    from transformers import LlamaForSequenceClassification, LlamaForTokenClassification

    classes = {"critic": LlamaForTokenClassification, "reward": LlamaForSequenceClassification}
    if kind not in classes:
        raise ValueError(f"kind must be one of {sorted(classes)}, got {kind!r}")
    directory = Path(directory)
    tokenizer = build_byte_tokenizer()
    torch.manual_seed(spec.seed + 1)
    model = classes[kind](_llama_config(len(tokenizer), spec, num_labels=1))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
