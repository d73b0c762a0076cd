"""Teacher-forced scoring in the rollout row layout: action log-probs, entropy, values, rewards.

Layout (rollout.proto): sequences (B, S) = P left-padded prompt columns + A right-padded action
columns. Action column j is token P + j and is scored by the output at position P + j - 1, so the
action outputs are positions S - A - 1 .. S - 2. Position ids are cumsum(mask) - 1 clamped at 0,
the rule generation uses, so a generated batch re-scores to the log-probs recorded while sampling.

Memory. The logits over the vocabulary are the largest tensors in RLHF scoring. Here rows go
through the model forward_batch_size at a time; the backbone gives hidden states, and lm_head is
applied to at most positions_per_chunk (row, column) pairs of the action columns at once, with
the float32 math on that block only: log p = z[label] - logsumexp(z). So the peak stays
O(chunk x V) even when the whole batch is scored in one forward; no (B, A, V) logits and no
(B, S, V) float32 log-softmax. On CUDA a plain Linear lm_head goes the other way round
(vocab_chunks.py): every action position of the forward batch at once against chunks of the
vocabulary, with an online log-sum-exp, so its weight is read once per forward batch rather than
once per block. Models whose logits are not plain lm_head(hidden) (soft-capped or
scaled) are scored through their own logits for the A + 1 positions we read (`logits_to_keep`).
Models are expected in eval mode (dropout off); nothing here changes their mode.

Paths. Where generation would run a model on rollserve's engine (server/generation/registry.py:
`scoring_path`, the same rule and the same --generation-path; the HF path on the CPU by
default), its decoder body runs on the engine's forward (`Forward.hidden_states`, the very
parameters of the HF module) and the model's own head is applied as above: lm_head in chunks for
the actor and reference, `score` for a critic (*ForTokenClassification) or a reward model
(*ForSequenceClassification). Any other model runs its Hugging Face forward. Both paths give the
same numbers up to the kernels' rounding. `path` (a server's GenerationSettings or a path name)
overrides the model's adopted settings; DEFAULT_SCORING_PATH decides for calls that name none.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...client.protocol.errors import FailedPrecondition, InvalidArgument
from ..generation import SCORING_CHUNK_BYTES, Forward, GenerationSettings, scoring_forward
from ..generation.compiling import maybe_compiled
from .vocab_chunks import vocab_chunked_log_probs, vocab_chunks_enabled

__all__ = [
    "DEFAULT_POSITIONS_PER_CHUNK",
    "ForwardBatches",
    "LmHeadPlan",
    "default_positions_per_chunk",
    "forward_batches",
    "lm_head_plan",
    "position_ids_from_mask",
    "action_log_probs",
    "critic_values",
    "last_real_index",
    "reward_scores",
]

# (row, column) pairs per float32 block at most; fewer for a large vocabulary, so that a float32
# block stays within SCORING_CHUNK_BYTES, the part of the memory budget the KV cache leaves to
# scoring (kv_cache.activation_reserve_bytes). The cap only matters for small vocabularies.
DEFAULT_POSITIONS_PER_CHUNK = 4096


def default_positions_per_chunk(model: torch.nn.Module) -> int:
    """DEFAULT_POSITIONS_PER_CHUNK, or fewer (at least 16) when a float32 block of the model's
    vocabulary would pass SCORING_CHUNK_BYTES."""
    vocab = _vocab_size(model)
    return max(16, min(DEFAULT_POSITIONS_PER_CHUNK, SCORING_CHUNK_BYTES // (4 * vocab)))


@dataclass(frozen=True)
class LmHeadPlan:
    """How the (rows, actions) positions of one forward batch go through lm_head: blocks of
    every row (when they fit) x `columns` action columns, so a block is one contiguous run of
    the column-major hidden states and the blocks are as few as the chunk allows."""

    rows: int  # rows per block
    columns: int  # action columns per block
    blocks: int  # lm_head calls for the forward batch


def lm_head_plan(rows: int, actions: int, positions_per_chunk: int) -> LmHeadPlan:
    """The blocks of at most positions_per_chunk (row, column) pairs for a (rows, actions)
    forward batch: all rows x as many columns as fit, else fewer rows x one column."""
    block_rows = min(rows, positions_per_chunk)
    block_columns = min(actions, max(1, positions_per_chunk // block_rows))
    blocks = -(-rows // block_rows) * -(-actions // block_columns)
    return LmHeadPlan(block_rows, block_columns, blocks)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids (B, S) int64 for left-padded rows: cumsum(mask) - 1, clamped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def _check_layout(
    sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int | None, batch_size: int
) -> None:
    if sequences.ndim != 2 or attention_mask.shape != sequences.shape:
        raise InvalidArgument(
            f"sequences and attention_mask must both be (B, S), got "
            f"{tuple(sequences.shape)} and {tuple(attention_mask.shape)}"
        )
    if num_actions is not None and not (1 <= num_actions < sequences.shape[1]):
        raise InvalidArgument(
            f"num_actions must lie in [1, S - 1] = [1, {sequences.shape[1] - 1}], got {num_actions}"
        )
    if batch_size < 1:
        raise InvalidArgument(f"forward_batch_size must be >= 1, got {batch_size}")


@dataclass(frozen=True)
class ForwardBatches:
    """The rows of a scoring call in forward batches (forward_batch_size rows at most), each
    without the leading columns that are padding in all of its rows.

    Rows go longest left-padded content first (a stable sort on the first real column: a GRPO
    group's rows share their prompt, so they stay together), so a batch holds rows of similar
    prompt length and trims more. Trimming is exact: no real query attends to a left pad
    (their masks and position ids, from cumsum(mask), are unchanged), and the trim never
    reaches the last `keep_last` columns (the action columns and the one before them).
    `restore` puts per-row results back in the caller's row order."""

    batches: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # (ids, mask) of each batch
    order: torch.Tensor | None  # sorted position -> caller's row; None: the caller's order

    def restore(self, results: torch.Tensor) -> torch.Tensor:
        """(B, ...) results in the batches' order -> in the caller's row order."""
        if self.order is None:
            return results
        restored = torch.empty_like(results)
        restored[self.order] = results
        return restored


def forward_batches(
    sequences: torch.Tensor, attention_mask: torch.Tensor, batch_size: int, keep_last: int
) -> ForwardBatches:
    """ForwardBatches of (B, S) rows: sorted when there is more than one batch, each batch
    trimmed of its all-padding leading columns, up to S - keep_last."""
    rows, width = sequences.shape
    real = attention_mask != 0
    first_real = torch.where(real.any(-1), real.int().argmax(-1), width)  # (B,) no sync
    order = None
    if rows > batch_size:
        order = torch.sort(first_real, stable=True).indices
        if bool((order == torch.arange(rows, device=order.device)).all()):
            order = None  # already in order: no gather, no scatter
        else:
            sequences, attention_mask = sequences[order], attention_mask[order]
            first_real = first_real[order]
    batches = []
    for start in range(0, rows, batch_size):
        stop = start + batch_size
        trim = min(int(first_real[start:stop].min()), width - keep_last)
        batches.append((sequences[start:stop, trim:], attention_mask[start:stop, trim:]))
    return ForwardBatches(tuple(batches), order)


def _logits_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(backbone, lm_head) when the model's logits are exactly lm_head(backbone hidden states).

    Most causal LMs (Llama, Qwen2/3, Mistral, Gemma 1, ...) compute logits so, but some scale
    or soft-cap them after the head (Gemma 2/3, Cohere, Granite). Rather than list
    architectures, the split is checked once per model against its own forward on a short
    probe and remembered; a model that fails the check is scored through its own logits.
    """
    if model in _HEAD_SPLITS:
        return _HEAD_SPLITS[model]
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    split = None
    if isinstance(backbone, torch.nn.Module) and isinstance(head, torch.nn.Module):
        device = head.weight.device if hasattr(head, "weight") else None
        vocab = model.get_input_embeddings().num_embeddings
        probe = (torch.arange(16, device=device) * 7919 % (vocab - 1) + 1)[None]  # (1, 16)
        with torch.inference_mode():
            full = model(input_ids=probe, use_cache=False).logits.float()
            hidden = backbone(input_ids=probe, use_cache=False).last_hidden_state
            mine = head(hidden).float()
        if mine.shape == full.shape and torch.allclose(mine, full, rtol=1e-4, atol=1e-5):
            split = (backbone, head)
    _HEAD_SPLITS[model] = split
    return split


# Models -> their checked (backbone, lm_head) split or None; weak, so models can be freed.
_HEAD_SPLITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# A server's GenerationSettings, a path name, or None (DEFAULT_SCORING_PATH).
ScoringPath = GenerationSettings | str | None

# The path of calls that name none (the maker's steps): "auto" follows the rule of generation
# (registry.scoring_path over the model's adopted settings: the engine's forward wherever
# generation runs on the engine); "hf" scores every model on its HF forward whatever the
# generation path. "auto" is the faster one measured on the CPU (the engine runs a group's
# prompt columns once); bench_gpu.py's scoring section measures both paths on a GPU.
DEFAULT_SCORING_PATH = "auto"


def _scoring_forward(model: torch.nn.Module, path: ScoringPath) -> Forward | None:
    """The engine's forward to score `model` on, or None for its HF forward (Paths)."""
    if path is None and DEFAULT_SCORING_PATH != "auto":
        path = DEFAULT_SCORING_PATH
    return scoring_forward(model, path)


def _engine_hidden(
    forward: Forward, ids: torch.Tensor, mask: torch.Tensor, keep: slice, actions: int = 0
) -> torch.Tensor:
    """The engine's final-normed hidden states (b, len(keep), H) of the columns `keep`; with
    `actions`, the S - actions prompt columns of a group's rows run once (Forward.hidden_states)."""
    prompt_width = ids.shape[1] - actions if actions else 0
    return forward.hidden_states(ids, mask, position_ids_from_mask(mask), prompt_width)[:, keep]


# (the action positions' final hidden states (A, b, H) column-major, lm_head's weight, bias)
LmHead = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class _ActionLogits:
    """A forward batch's action logits on demand: `block(rows, columns)` (see _action_logits);
    `head`, when the logits are a plain Linear of hidden states, what vocab_chunks.py reads
    instead of blocks."""

    block: Callable[[slice, slice], torch.Tensor]
    head: LmHead | None = None


def _linear_head(by_column: torch.Tensor, head: torch.nn.Module) -> LmHead | None:
    if type(head) is not torch.nn.Linear:
        return None
    return by_column, head.weight, head.bias


def _action_logits(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, actions: int, path: ScoringPath
) -> _ActionLogits:
    """The logits (columns x rows, V) of a block of action columns, on demand, flattened
    column-major (position c * rows + r); with lm_head's parts where they can be read.

    Action column j is scored at position S - A - 1 + j. On the engine, or with a checked
    lm_head split, the backbone runs once, its hidden states of the action positions are laid
    out column-major (A, b, H) once, and lm_head is applied to the requested block only, as
    one (positions, H) matrix: a block of every row is one contiguous run, so F.linear is one
    mm. (A 3-D block of a strided view made it a bmm over the rows with lm_head's weight
    broadcast, for a model without grad as a server loads it: the whole weight read once per
    row per block.) No (b, A, V) tensor ever exists; otherwise the model computes its logits
    for the last A + 1 positions (`logits_to_keep` where supported) and blocks are read from
    them.
    """
    forward = _scoring_forward(model, path)
    if forward is not None and forward.family.lm_head is not None:
        hidden = _engine_hidden(forward, ids, mask, slice(-actions - 1, -1), actions)  # (b, A, H)
        by_column = hidden.transpose(0, 1).contiguous()  # (A, b, H)
        return _ActionLogits(
            lambda rows, columns: forward.logits(by_column[columns, rows].flatten(0, 1)),
            _linear_head(by_column, forward.family.lm_head),
        )
    position_ids = position_ids_from_mask(mask)
    split = _logits_head(model)
    if split is not None:
        backbone, head = split
        out = backbone(
            input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False
        )
        by_column = out.last_hidden_state[:, -actions - 1 : -1].transpose(0, 1).contiguous()
        return _ActionLogits(
            lambda rows, columns: head(by_column[columns, rows].flatten(0, 1)),
            _linear_head(by_column, head),
        )
    kwargs = {}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        # An int keeps the last N positions (transformers' slice_logits_to_keep); the last
        # position scores nothing, so keep A + 1 and drop it (a view, no copy).
        kwargs["logits_to_keep"] = actions + 1
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False, **kwargs
    )
    logits = out.logits[:, -actions - 1 : -1]  # (b, A, V)
    return _ActionLogits(lambda rows, columns: logits[rows, columns].transpose(0, 1).flatten(0, 1))


def _block_log_probs(
    z: torch.Tensor,
    labels: torch.Tensor,
    temperature: float | torch.Tensor | None,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) and entropy (n,) of logits z (n, V) float32, which it overwrites.

    log p = z[label] - logsumexp(z), computed in place on z: one float32 block (two with
    entropy) is the whole transient, where torch.logsumexp and a softmax hold three. z may
    alias the model's own float32 logits: each block is read once, so overwriting is safe.
    """
    if temperature is not None:
        z.div_(temperature)
    picked = z.gather(-1, labels[:, None])[:, 0]  # (n,)
    top = z.amax(-1, keepdim=True)  # (n, 1)
    top = top.masked_fill(top.isinf(), 0.0)  # as torch.logsumexp: no inf - inf
    if not with_entropy:
        total = z.sub_(top).exp_().sum(-1, keepdim=True)
        return picked - (total.log_() + top)[:, 0], None
    exp = (z - top).exp_()  # (n, V)
    total = exp.sum(-1, keepdim=True)
    log_norm = (total.log() + top)[:, 0]
    # H = logsumexp(z) - sum softmax(z) * z, softmax = exp / total. A token at -inf has
    # probability 0 and adds 0 (not 0 x -inf = nan): z is clamped to the lowest finite float.
    z = z.clamp_min_(torch.finfo(z.dtype).min)
    entropy = log_norm - exp.mul_(z).sum(-1) / total[:, 0]
    return picked - log_norm, entropy


def _fused_block_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: torch.Tensor,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """_block_log_probs of the model-dtype logits (n, V), leaving them untouched: the function
    torch.compile fuses (FUSED_BLOCK_DEVICES).

    Compiled, the in-place steps on the private float32 copy become pure ones and Inductor
    folds the cast, the temperature and the exponentials into its row reductions: the block is
    read two or three times in the model's dtype and no (n, V) float32 tensor is stored, where
    the eager steps make five or six float32 passes. Run eagerly (after a compiler failure) it
    is those steps on one float32 copy. The temperature is a 0-d tensor (1 for none), so a new
    value does not recompile; with_entropy is the graph's structure.
    """
    z = logits.to(torch.float32, copy=True)  # a copy even from float32: never the caller's
    return _block_log_probs(z, labels, temperature, with_entropy)


# Device types whose blocks go through the compiled _fused_block_log_probs. The CPU keeps the
# eager in-place steps by default: compiled measured faster there too once compiled (1.2-1.7x
# on a float32 (4096, 32000) block, 2.5-4x on bfloat16, a busy 2-core CPU), but each new block
# shape and vocabulary compiles for seconds on the CPU, where scoring serves tests and small runs.
FUSED_BLOCK_DEVICES: frozenset[str] = frozenset({"cuda"})


@functools.cache
def _fused_block() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """The compiled _fused_block_log_probs, made on first use: one per process (torch.compile
    keys its cache by function, so every model and request shares its graphs)."""
    return maybe_compiled(_fused_block_log_probs, True)


def _fused_scorer(
    device: torch.device, temperature: float | None, with_entropy: bool
) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]] | None:
    """(model-dtype logits block, labels) -> (log p, entropy or None) through the compiled
    _fused_block_log_probs on FUSED_BLOCK_DEVICES; None elsewhere (the eager steps)."""
    if device.type not in FUSED_BLOCK_DEVICES:
        return None
    fused = _fused_block()
    # One tensor per call, not per block, and no Python float in the graph (dynamo may
    # specialise on its value). No temperature divides by 1, exactly: one graph less.
    divisor = torch.tensor(1.0 if temperature is None else temperature, device=device)
    return lambda z, labels: fused(z, labels, divisor, with_entropy)


def _chunked_log_probs(
    logits_of: Callable[[slice, slice], torch.Tensor],
    labels: torch.Tensor,
    temperature: float | None,
    with_entropy: bool,
    positions_per_chunk: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) and entropy (b, A) float32, block by block (lm_head_plan): log p = z[label]
    - logsumexp(z), never a full log-softmax. No host synchronisation in the loop: on a GPU
    the blocks queue back to back."""
    rows, actions = labels.shape
    plan = lm_head_plan(rows, actions, positions_per_chunk)
    labels_by_column = labels.t()  # (A, b)
    log_probs = torch.empty((actions, rows), dtype=torch.float32, device=labels.device)
    entropy = torch.empty_like(log_probs) if with_entropy else None
    # The labels sit on the logits' device (gather needs it).
    fused = _fused_scorer(labels.device, temperature, with_entropy)
    for c in range(0, actions, plan.columns):
        for r in range(0, rows, plan.rows):
            block = (slice(c, c + plan.columns), slice(r, r + plan.rows))
            z = logits_of(block[1], block[0])  # (columns x rows, V), the model's dtype
            picked = labels_by_column[block].reshape(-1)
            if fused is not None:
                lp, ent = fused(z, picked)
            else:
                # The model-dtype logits are dropped as soon as their float32 copy exists.
                z = z.float()
                lp, ent = _block_log_probs(z, picked, temperature, with_entropy)
            del z
            log_probs[block] = lp.view(log_probs[block].shape)
            if entropy is not None:
                entropy[block] = ent.view(entropy[block].shape)
    return log_probs.t().contiguous(), None if entropy is None else entropy.t().contiguous()


def _vocab_chunks(
    head: LmHead,
    labels: torch.Tensor,
    temperature: float | None,
    with_entropy: bool,
    chunk_bytes: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) and entropy (b, A) of a forward batch through vocab_chunks.py: every action
    position (column-major, as the hidden states are laid out) in passes over the vocabulary."""
    by_column, weight, bias = head
    actions, rows = by_column.shape[:2]
    extra = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    lp, ent = vocab_chunked_log_probs(
        by_column.flatten(0, 1), weight, bias, labels.t().reshape(-1), temperature, with_entropy,
        compiled=labels.device.type in FUSED_BLOCK_DEVICES, **extra,
    )  # fmt: skip

    def by_row(values: torch.Tensor) -> torch.Tensor:
        return values.view(actions, rows).t().contiguous()

    return by_row(lp), None if ent is None else by_row(ent)


def _vocab_size(model: torch.nn.Module) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return getattr(head, "out_features", None) or model.get_input_embeddings().num_embeddings


def action_log_probs(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    num_actions: int,
    *,
    forward_batch_size: int,
    temperature: float | None = None,
    with_entropy: bool = False,
    positions_per_chunk: int | None = None,
    path: ScoringPath = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, A) float32 of the action tokens under a causal LM, and optionally entropy.

    temperature: divide the logits by it first (logprobs_use_temperature); None means raw logits.
    Masked columns are scored like any other (callers apply the action mask). path: see Paths.
    positions_per_chunk: None picks DEFAULT_POSITIONS_PER_CHUNK, or fewer for a vocabulary
    whose float32 block would pass SCORING_CHUNK_BYTES.
    """
    # The vocabulary chunks' bound: their default, or the memory of the blocks asked for.
    chunk_bytes = None
    if positions_per_chunk is None:
        positions_per_chunk = default_positions_per_chunk(model)
    else:
        chunk_bytes = 4 * positions_per_chunk * _vocab_size(model)
    _check_layout(sequences, attention_mask, num_actions, forward_batch_size)
    if temperature is not None and not temperature > 0:
        raise InvalidArgument(f"temperature must be > 0 or None, got {temperature}")
    if positions_per_chunk < 1:
        raise InvalidArgument(f"positions_per_chunk must be >= 1, got {positions_per_chunk}")
    log_probs, entropies = [], []
    with torch.inference_mode():
        plan = forward_batches(sequences, attention_mask, forward_batch_size, num_actions + 1)
        for ids, mask in plan.batches:  # (b, S') each
            logits = _action_logits(model, ids, mask, num_actions, path)
            labels = ids[:, -num_actions:]
            if logits.head is not None and vocab_chunks_enabled(labels.device):
                lp, ent = _vocab_chunks(logits.head, labels, temperature, with_entropy, chunk_bytes)
            else:
                lp, ent = _chunked_log_probs(
                    logits.block, labels, temperature, with_entropy, positions_per_chunk
                )
            del logits  # free this micro-batch's hidden states or logits before the next
            log_probs.append(lp)
            entropies.append(ent)
        entropy = plan.restore(torch.cat(entropies)) if with_entropy else None
        return plan.restore(torch.cat(log_probs)), entropy


def critic_values(
    critic: torch.nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    num_actions: int,
    *,
    forward_batch_size: int,
    path: ScoringPath = None,
) -> torch.Tensor:
    """Values (B, A) float32 from a one-label token-classification critic.

    The value of action column j is read at position P + j - 1, the hidden state BEFORE token
    P + j: the state in which the action was chosen, aligned with its log-prob (OpenRLHF and
    LightRFT: values[:, :-1][:, -A:]). On the engine (see Paths) the body runs there and the
    critic's `score` head reads only those positions.
    """
    _check_layout(sequences, attention_mask, num_actions, forward_batch_size)
    forward, head = _engine_body_and_head(critic, path, "ForTokenClassification")
    values = []
    with torch.inference_mode():
        plan = forward_batches(sequences, attention_mask, forward_batch_size, num_actions + 1)
        for ids, mask in plan.batches:
            if forward is not None:
                keep = slice(-num_actions - 1, -1)
                hidden = _engine_hidden(forward, ids, mask, keep, num_actions)
                values.append(_single_label(head(hidden), expected_ndim=3))
                continue
            out = critic(
                input_ids=ids,
                attention_mask=mask,
                position_ids=position_ids_from_mask(mask),
                use_cache=False,
            )
            per_token = _single_label(out.logits, expected_ndim=3)  # (b, S)
            values.append(per_token[:, -num_actions - 1 : -1])
        return plan.restore(torch.cat(values))


def _engine_body_and_head(
    model: torch.nn.Module, path: ScoringPath, kind: str
) -> tuple[Forward | None, torch.nn.Module | None]:
    """(the engine's forward over model's body, its `score` head) when scoring runs the body
    on the engine, the model is a transformers *For<kind> (whose output is score(body); a
    critic's dropout before it is the identity in eval mode) and the head a plain Linear,
    else (None, None): HF."""
    head = getattr(model, "score", None)
    if not type(model).__name__.endswith(kind) or type(head) is not torch.nn.Linear:
        return None, None
    if model.training:
        return None, None
    forward = _scoring_forward(model, path)
    return (forward, head) if forward is not None else (None, None)


def _single_label(logits: torch.Tensor, *, expected_ndim: int) -> torch.Tensor:
    """Drop the label axis of a one-label head, as float32; refuse heads with more labels."""
    if logits.ndim != expected_ndim or logits.shape[-1] != 1:
        raise FailedPrecondition(
            f"a scalar head needs exactly one label; the model returned logits of shape "
            f"{tuple(logits.shape)}"
        )
    return logits[..., 0].float()


def last_real_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Column (B,) int64 of the last attention-1 position of each row."""
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (columns * attention_mask.long()).argmax(-1)


def reward_scores(
    reward_model: torch.nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    forward_batch_size: int,
    path: ScoringPath = None,
) -> torch.Tensor:
    """Scores (B,) float32 of a one-label sequence classifier, read at each row's last real token.

    Models with a `score` head (every transformers *ForSequenceClassification built on
    GenericForSequenceClassification, e.g. Llama, Qwen2, Mistral) run their backbone and apply
    `score` to the hidden state at the last attention-1 position, instead of HF's pooling at the
    last token != pad_token_id, which reads the wrong position when pad == eos. Other models
    (e.g. BERT-style `classifier` heads) fall back to one forward per row on its real tokens
    only, so whatever pooling the model does sees no padding: exact, but slower.
    """
    _check_layout(sequences, attention_mask, None, forward_batch_size)
    if not bool(attention_mask.any(-1).all()):
        raise InvalidArgument("every row needs at least one attention-1 token to be scored")
    backbone = getattr(reward_model, getattr(reward_model, "base_model_prefix", ""), None)
    head = getattr(reward_model, "score", None)
    if not isinstance(backbone, torch.nn.Module) or not isinstance(head, torch.nn.Module):
        return _reward_scores_per_row(reward_model, sequences, attention_mask)
    # The engine runs the body of a *ForSequenceClassification (Paths); the head is as below.
    forward, _ = _engine_body_and_head(reward_model, path, "ForSequenceClassification")
    scores = []
    with torch.inference_mode():
        plan = forward_batches(sequences, attention_mask, forward_batch_size, 1)
        for ids, mask in plan.batches:
            if forward is not None:
                hidden = _engine_hidden(forward, ids, mask, slice(None))  # (b, S, H)
            else:
                hidden = backbone(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=position_ids_from_mask(mask),
                    use_cache=False,
                ).last_hidden_state  # (b, S, H)
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            last = hidden[rows, last_real_index(mask)]  # (b, H)
            scores.append(_single_label(head(last), expected_ndim=2))
        return plan.restore(torch.cat(scores))


def _reward_scores_per_row(
    reward_model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Fallback: score each row alone on its real tokens (no padding for the model to misread)."""
    scores = []
    with torch.inference_mode():
        for ids, mask in zip(sequences, attention_mask, strict=True):
            real = ids[mask.bool()][None]  # (1, L)
            logits = reward_model(input_ids=real, attention_mask=torch.ones_like(real)).logits
            scores.append(_single_label(logits, expected_ndim=2))
    return torch.cat(scores)
