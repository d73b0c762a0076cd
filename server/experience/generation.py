"""Batched sampling from a Hugging Face causal LM with a KV cache, in the rollout row layout.

Layout (rollout.proto): prompts LEFT-padded to a common width P, responses RIGHT-padded to a
common width A = the longest response in the batch, S = P + A. Position ids are
cumsum(attention_mask) - 1 clamped at 0, the same rule scoring uses, so log-probs recorded here
equal teacher-forced re-scoring of the returned sequences.

Stop rule. A row is finished after the first complete occurrence of any stop sequence inside its
response (an occurrence may not reach back into the prompt); the occurrence is kept and is part
of the action mask. min_new_tokens follows Hugging Face's MinNewTokensLengthLogitsProcessor: at a
step where the row has generated t < min_new_tokens tokens, the ids of single-token stop
sequences are removed from the sampling distribution, and a multi-token occurrence completed by
that step does not count. So a stopped row has at least min_new_tokens tokens before the token
that completes its stop sequence.

Log-probs. Per step, log_softmax(logits [/ temperature when logprobs_use_temperature]) at the
sampled token, in float32, over the UNFILTERED distribution: top-k, top-p and the
min_new_tokens mask shape sampling only (the proto's definition; a trainer can reproduce it by
teacher forcing). Greedy decoding (temperature 0) never divides. Columns after a row finished
hold log-prob 0, token pad_token_id, attention 0 and action mask 0.

Prefix sharing. Rows with the same prompt (a GRPO group of n samples) are prefilled once: the
distinct prompts run through the model in the batch's left-padded layout, then each one's KV
cache and last logits are copied to the rows of its group, and decoding goes on with all B rows.
Sampling draws the same random numbers in the same order as with a prefill of every row, so a
seed gives the same tokens; the prefill's matmuls run on fewer rows, so on CPU the logits (and
recorded log-probs) may differ from a full prefill in the last bit (~1e-7).

Paths. Supported Llama-family models run on rollserve's engine (server/generation: static KV
cache, on-device sampling, CUDA graphs), the rest on the Hugging Face model with the code
below; `path` (a server's GenerationSettings, from --generation-path) picks: "auto" (the engine
on CUDA), "rollserve" or "hf". Both paths follow every rule above and give the same greedy
tokens. They draw random numbers differently (the engine draws one (B, max_new_tokens) table
of uniforms up front), so a seed gives reproducible tokens on each path, not the same tokens
on both.
"""

from __future__ import annotations

import inspect
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...client.protocol.errors import InvalidArgument
from ..generation import GenerationSettings, engine_for

__all__ = ["MIN_TEMPERATURE", "SamplingParams", "GenerationOutput", "generate", "left_pad"]

# The smallest positive sampling temperature, 1e-6 as a proto float (float32) carries it. Logits
# divided by one near float32's smallest values overflow to infinity (a subnormal 1e-40 did so for
# every logit): NaN log-probs, KL and advantages came back with status OK. 0 is greedy.
MIN_TEMPERATURE: float = struct.unpack("<f", struct.pack("<f", 1e-6))[0]


@dataclass(frozen=True)
class SamplingParams:
    """How responses are sampled (SamplingOptions of the proto, resolved to plain values)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    logprobs_use_temperature: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise InvalidArgument(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgument(f"temperature must be finite and >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InvalidArgument(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got "
                f"{self.temperature!r}: logits divided by it overflow"
            )
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"top_p must lie in (0, 1], got {self.top_p}")
        for seq in self.stop_sequences:
            if len(seq) == 0 or min(seq) < 0:
                raise InvalidArgument(f"stop_sequences: each needs >= 1 id >= 0, got {seq!r}")


@dataclass(frozen=True)
class GenerationOutput:
    """One generated batch in the rollout layout. B rows, S = prompt_width + A columns."""

    sequences: torch.Tensor  # (B, S) int64, pads = pad_token_id
    attention_mask: torch.Tensor  # (B, S) bool, true on real prompt and response tokens
    action_mask: torch.Tensor  # (B, A) bool, prefix mask of valid response tokens
    action_log_probs: torch.Tensor  # (B, A) float32, recorded while sampling; 0 where masked
    prompt_width: int  # P
    response_lengths: torch.Tensor  # (B,) int64, valid action count per row
    truncated: torch.Tensor  # (B,) bool, true where no stop sequence was hit


def left_pad(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad ragged prompts to their longest length: ids (B, P) int64 and mask (B, P) bool."""
    if len(prompts) == 0:
        raise InvalidArgument("prompts must not be empty")
    width = max(len(p) for p in prompts)
    if min(len(p) for p in prompts) < 1:
        raise InvalidArgument("every prompt needs at least one token")
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.as_tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = True
    return ids.to(device), mask.to(device)


class _StopMatcher:
    """Finds stop-sequence completions on device from a rolling window of the last tokens."""

    def __init__(self, stop_sequences: tuple[tuple[int, ...], ...], device: torch.device) -> None:
        by_length: dict[int, list[tuple[int, ...]]] = {}
        for seq in dict.fromkeys(stop_sequences):  # dedupe, keep order
            by_length.setdefault(len(seq), []).append(seq)
        # One (n_L, L) tensor per length L, so a step costs one comparison per distinct length.
        self.groups = [
            (length, torch.tensor(seqs, dtype=torch.long, device=device))
            for length, seqs in sorted(by_length.items())
        ]
        self.width = max(by_length, default=1)
        single = by_length.get(1, [])
        self.single_ids = torch.tensor([s[0] for s in single], dtype=torch.long, device=device)

    def hits(self, window: torch.Tensor, generated: int) -> torch.Tensor:
        """Rows whose window (b, width) ends with a stop sequence that lies inside the response."""
        hit = torch.zeros(window.shape[0], dtype=torch.bool, device=window.device)
        for length, seqs in self.groups:
            if length > generated:  # would reach back into the prompt
                break
            tail = window[:, -length:]  # (b, L)
            hit |= (tail[:, None, :] == seqs[None, :, :]).all(-1).any(-1)
        return hit


def _candidates(
    scores: torch.Tensor, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scores a row may sample from, (b, n), and their token ids (None: n = V, in id order).

    With top-k the candidates are the k best (sorted), with top-p alone the whole vocabulary
    sorted; top-p then sets the tail beyond the nucleus to -inf (HF order: top-k, then top-p
    over the survivors' softmax; at least one token is kept).
    """
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        values, ids = torch.topk(scores, top_k, dim=-1)  # (b, k) descending
    elif top_p < 1.0:
        values, ids = torch.sort(scores, dim=-1, descending=True)  # (b, V)
    else:
        return scores, None
    if top_p < 1.0:
        probs = torch.softmax(values, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # Index 0 always survives: its mass_before is 0 < top_p.
        values = values.masked_fill(mass_before >= top_p, float("-inf"))
    return values, ids


def _draw(scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row of scores (b, n) from softmax(scores), by inverse CDF.

    One uniform number per row instead of torch.multinomial's one per row and candidate (its
    exponential_ over (B, V) is a visible share of a CPU decoding step). float64 cumsum keeps
    the tail of a 150k vocabulary exact enough; tokens with probability 0 are never picked
    because the search takes the first index whose CDF exceeds u.
    """
    cdf = torch.softmax(scores, dim=-1).cumsum(-1, dtype=torch.float64)  # (b, n)
    u = torch.rand(
        (scores.shape[0], 1), generator=generator, dtype=torch.float64, device=scores.device
    )
    pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # (b, 1)
    return pick.clamp_max(scores.shape[-1] - 1).squeeze(1)


def _sample(
    logits: torch.Tensor,
    params: SamplingParams,
    ban_ids: torch.Tensor | None,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from logits (b, V); return it (b,) and its log-prob (b,) float32."""
    raw = logits.float()  # (b, V)
    greedy = params.temperature == 0.0
    scaled = raw if greedy or params.temperature == 1.0 else raw / params.temperature
    base = scaled if params.logprobs_use_temperature else raw
    scores = scaled
    if ban_ids is not None:
        scores = scaled.clone()  # `base` may alias `scaled` and must stay unfiltered
        scores[:, ban_ids] = float("-inf")
    if greedy:
        token = scores.argmax(dim=-1)  # (b,)
    else:
        values, ids = _candidates(scores, params.top_k, params.top_p)
        pick = _draw(values, generator)  # (b,)
        token = pick if ids is None else ids.gather(-1, pick[:, None]).squeeze(1)
    log_prob = base.gather(-1, token[:, None]).squeeze(1) - torch.logsumexp(base, dim=-1)
    return token, log_prob


def _prefill_kwargs(model: torch.nn.Module) -> dict[str, int]:
    """Ask only for the last position's logits in prefill when the model supports it."""
    params = inspect.signature(model.forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def _check_inputs(model: torch.nn.Module, ids: torch.Tensor, params: SamplingParams) -> None:
    vocab = model.get_input_embeddings().num_embeddings
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise InvalidArgument(f"prompt token ids must lie in [0, {vocab})")
    if any(max(seq) >= vocab for seq in params.stop_sequences):
        raise InvalidArgument(f"stop_sequences ids must lie in [0, {vocab})")
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and ids.shape[1] + params.max_new_tokens > context:
        raise InvalidArgument(
            f"longest prompt ({ids.shape[1]}) + max_new_tokens ({params.max_new_tokens}) "
            f"exceeds the model context ({context})"
        )


@dataclass
class _Active:
    """Decoding state of the rows still in the KV cache, in cache order (mutable, loop-local)."""

    rows: torch.Tensor  # (b,) indices into the output batch
    attention: torch.Tensor  # (b, P + M) bool
    positions: torch.Tensor  # (b, 1) position id of the next input token
    window: torch.Tensor  # (b, W) last W tokens, for stop matching
    finished: torch.Tensor  # (b,) bool

    @classmethod
    def start(
        cls,
        prompt_mask: torch.Tensor,
        positions: torch.Tensor,
        budget: int,
        window: int,
        pad_token_id: int,
    ) -> _Active:
        """Every row active, attention over the prompt and room for `budget` new tokens."""
        batch, device = prompt_mask.shape[0], prompt_mask.device
        return cls(
            rows=torch.arange(batch, device=device),
            attention=torch.cat([prompt_mask, prompt_mask.new_zeros((batch, budget))], dim=1),
            positions=positions[:, -1:] + 1,
            window=torch.full((batch, window), pad_token_id, dtype=torch.long, device=device),
            finished=torch.zeros(batch, dtype=torch.bool, device=device),
        )

    def compact(self, cache: object) -> torch.Tensor:
        """Drop finished rows from the state and the KV cache; return the kept cache rows."""
        keep = (~self.finished).nonzero().squeeze(1)
        cache.batch_select_indices(keep)  # type: ignore[attr-defined]
        for name in ("rows", "attention", "positions", "window", "finished"):
            setattr(self, name, getattr(self, name)[keep])
        return keep


@dataclass
class _Outputs:
    """Per-row results in batch order, filled one column per step (mutable, loop-local)."""

    response: torch.Tensor  # (B, M) int64, pad where not generated
    log_probs: torch.Tensor  # (B, M) float32, 0 where not generated
    response_mask: torch.Tensor  # (B, M) bool
    stopped: torch.Tensor  # (B,) bool, a stop sequence was hit

    @classmethod
    def empty(cls, batch: int, budget: int, pad_token_id: int, device: torch.device) -> _Outputs:
        return cls(
            response=torch.full((batch, budget), pad_token_id, dtype=torch.long, device=device),
            log_probs=torch.zeros((batch, budget), dtype=torch.float32, device=device),
            response_mask=torch.zeros((batch, budget), dtype=torch.bool, device=device),
            stopped=torch.zeros(batch, dtype=torch.bool, device=device),
        )

    def record(
        self, state: _Active, step: int, token: torch.Tensor, log_prob: torch.Tensor
    ) -> None:
        live = ~state.finished
        self.response[state.rows, step] = token
        self.log_probs[state.rows, step] = torch.where(live, log_prob, 0.0)
        self.response_mask[state.rows, step] = live


def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    pad_token_id: int,
    generator: torch.Generator,
    share_prefill: bool = True,
    path: GenerationSettings | str | None = None,
) -> GenerationOutput:
    """Sample responses for ragged prompts with a KV cache (`generator` on the model's device).

    share_prefill: rows with the same prompt (a GRPO group) share one prefill (see _prefill);
    False prefills every row, for comparisons. Both give the same output. path: the server's
    GenerationSettings, or a path name "auto", "rollserve" or "hf" with the default KV budget
    (None: auto; see Paths above).
    """
    device = model.get_input_embeddings().weight.device
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, device)  # (B, P)
    _check_inputs(model, prompt_ids, params)
    batch, width = prompt_ids.shape
    budget = params.max_new_tokens
    engine = engine_for(model, path)
    if engine is not None and engine.fits(width, budget):
        result = engine.generate(
            prompt_ids, prompt_mask, params, pad_token_id=pad_token_id, generator=generator,
            share_prefill=share_prefill,
        )  # fmt: skip
        engine_outputs = _Outputs(
            result.response, result.log_probs, result.response_mask, result.stopped
        )
        return _assemble(prompt_ids, prompt_mask, engine_outputs)
    stops = _StopMatcher(params.stop_sequences, device)
    ban_ids = stops.single_ids if params.min_new_tokens > 0 and stops.single_ids.numel() else None
    outputs = _Outputs.empty(batch, budget, pad_token_id, device)
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp_min(0)  # (B, P), as in scoring
    state = _Active.start(prompt_mask, positions, budget, stops.width, pad_token_id)
    with torch.inference_mode():
        shared = share_prefill
        logits, cache = _prefill(model, prompts, prompt_ids, prompt_mask, positions, shared)
        for step in range(budget):
            ban = ban_ids if step < params.min_new_tokens else None
            token, log_prob = _sample(logits, params, ban, generator)  # (b,)
            token = torch.where(state.finished, pad_token_id, token)
            outputs.record(state, step, token, log_prob)
            state.attention[:, width + step] = ~state.finished
            state.window = torch.cat([state.window[:, 1:], token[:, None]], dim=1)
            if step >= params.min_new_tokens:
                state.finished |= stops.hits(state.window, step + 1)
            done = int(state.finished.sum())  # the one host sync per step
            if step + 1 == budget or done == state.rows.numel():
                break
            if 2 * done >= state.rows.numel() and hasattr(cache, "batch_select_indices"):
                # Finished rows are half the cache: drop them, so later steps only compute
                # rows that still need tokens (the copy is amortised by the halving).
                outputs.stopped[state.rows] = state.finished
                token = token[state.compact(cache)]
            out = model(
                input_ids=token[:, None],
                attention_mask=state.attention[:, : width + step + 1],
                position_ids=state.positions,
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1]
            state.positions = state.positions + 1
        outputs.stopped[state.rows] = state.finished
        return _assemble(prompt_ids, prompt_mask, outputs)


def _distinct_rows(prompts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """The first row of each distinct prompt, and for every row the index of its prompt there."""
    index: dict[tuple[int, ...], int] = {}
    firsts: list[int] = []
    of_row: list[int] = []
    for row, prompt in enumerate(prompts):
        key = tuple(prompt)
        if key not in index:
            index[key] = len(firsts)
            firsts.append(row)
        of_row.append(index[key])
    return firsts, of_row


def _prefill(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    positions: torch.Tensor,
    share: bool,
) -> tuple[torch.Tensor, object]:
    """Run the prompts once: last-position logits (B, V) and the KV cache of every row.

    Prefix sharing: each distinct prompt is prefilled once, in the same left-padded layout
    (width P) it has in the batch, then its KV cache and logits are copied to every row of its
    group. Each row sees exactly the inputs it would see in a prefill of all B rows, so the
    logits, and the random numbers sampling draws from them, stay the same.
    """
    firsts, of_row = _distinct_rows(prompts)
    if share and len(firsts) < len(prompts):
        distinct = torch.tensor(firsts, device=prompt_ids.device)
        logits, cache = _forward_prompts(model, prompt_ids, prompt_mask, positions, distinct)
        if hasattr(cache, "batch_select_indices"):  # else: a cache we cannot expand
            expand = torch.tensor(of_row, device=prompt_ids.device)  # (B,)
            cache.batch_select_indices(expand)  # repeated indices copy a row to its group
            return logits[expand], cache
    return _forward_prompts(model, prompt_ids, prompt_mask, positions, slice(None))


def _forward_prompts(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor | slice,
) -> tuple[torch.Tensor, object]:
    """One prefill forward of the chosen rows: last-position logits (b, V) and the KV cache."""
    out = model(
        input_ids=prompt_ids[rows],
        attention_mask=prompt_mask[rows],
        position_ids=positions[rows],
        use_cache=True,
        **_prefill_kwargs(model),
    )
    return out.logits[:, -1], out.past_key_values


def _assemble(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, outputs: _Outputs
) -> GenerationOutput:
    """Trim the response buffers to the longest response and join them to the prompts."""
    lengths = outputs.response_mask.sum(-1)  # (B,)
    actions = int(lengths.max())
    action_mask = outputs.response_mask[:, :actions]
    return GenerationOutput(
        sequences=torch.cat([prompt_ids, outputs.response[:, :actions]], dim=1),
        attention_mask=torch.cat([prompt_mask, action_mask], dim=1),
        action_mask=action_mask.clone(),
        action_log_probs=outputs.log_probs[:, :actions].clone(),
        prompt_width=prompt_ids.shape[1],
        response_lengths=lengths,
        truncated=~outputs.stopped,
    )
