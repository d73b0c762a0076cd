"""Teacher-forced scoring on real tiny models: chunked log-probs, entropy, values, rewards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rollserve.client.protocol.errors import FailedPrecondition, InvalidArgument
from rollserve.server.experience.scoring import (
    action_log_probs,
    critic_values,
    forward_batches,
    last_real_index,
    position_ids_from_mask,
    reward_scores,
)

PAD = 0
# (prompt, response) pairs of different lengths; ids avoid the pad id except where a test says.
ROWS = [
    ([5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16]),
    ([20, 21], [22, 23, 24]),
    ([30, 31, 32, 33], [34]),
    ([40], [41, 42, 43, 44, 45, 46, 47]),
    ([50, 51, 52], [53, 54, 55, 56]),
]


def layout(rows=ROWS) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prompts left-padded to P, responses right-padded to A: sequences, mask (B, P + A), A."""
    width = max(len(p) for p, _ in rows)
    actions = max(len(r) for _, r in rows)
    ids = torch.full((len(rows), width + actions), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (prompt, response) in enumerate(rows):
        ids[i, width - len(prompt) : width + len(response)] = torch.tensor(prompt + response)
        mask[i, width - len(prompt) : width + len(response)] = True
    return ids, mask, actions


@pytest.fixture(scope="module")
def actor(tiny_actor_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_actor_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def critic(tiny_critic_dir: Path):
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        tiny_critic_dir, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def reward(tiny_reward_dir: Path):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(
        tiny_reward_dir, dtype=torch.float32
    ).eval()


def test_position_ids_from_mask() -> None:
    mask = torch.tensor(
        [[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]], dtype=torch.bool
    )
    expected = torch.tensor([[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5], [0, 0, 1, 1, 1, 1]])
    got = position_ids_from_mask(mask)
    assert got.dtype == torch.int64 and torch.equal(got, expected)


def naive_reference(actor, ids, mask, actions, temperature=None):
    """Full float32 log-softmax over (B, S, V), then the action columns: the thing we avoid."""
    with torch.inference_mode():
        logits = actor(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
        ).logits
    logits = logits.float()[:, -actions - 1 : -1]  # (B, A, V) scoring columns P-1 .. S-2
    if temperature is not None:
        logits = logits / temperature
    log_soft = torch.log_softmax(logits, dim=-1)
    log_probs = log_soft.gather(-1, ids[:, -actions:, None]).squeeze(-1)
    entropy = -(log_soft.exp() * log_soft).sum(-1)
    return log_probs, entropy


@pytest.mark.parametrize("positions_per_chunk", [1, 3, 7, 16, 4096])
@pytest.mark.parametrize("forward_batch_size", [1, 2, 5, 64])
def test_chunked_log_probs_and_entropy_equal_the_naive_reference(
    actor, positions_per_chunk: int, forward_batch_size: int
) -> None:
    ids, mask, actions = layout()
    ref_lp, ref_ent = naive_reference(actor, ids, mask, actions)
    lp, ent = action_log_probs(
        actor, ids, mask, actions, forward_batch_size=forward_batch_size,
        with_entropy=True, positions_per_chunk=positions_per_chunk,
    )  # fmt: skip
    assert lp.shape == ent.shape == (len(ROWS), actions)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.3, 1.7])
def test_temperature_divides_the_logits(actor, temperature: float) -> None:
    ids, mask, actions = layout()
    ref_lp, ref_ent = naive_reference(actor, ids, mask, actions, temperature)
    lp, ent = action_log_probs(
        actor, ids, mask, actions, forward_batch_size=2, temperature=temperature,
        with_entropy=True, positions_per_chunk=5,
    )  # fmt: skip
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    plain, _ = action_log_probs(actor, ids, mask, actions, forward_batch_size=2)
    assert not torch.allclose(lp, plain)


def test_entropy_is_optional(actor) -> None:
    ids, mask, actions = layout()
    without, none = action_log_probs(actor, ids, mask, actions, forward_batch_size=3)
    with_entropy, _ = action_log_probs(
        actor, ids, mask, actions, forward_batch_size=3, with_entropy=True
    )
    assert none is None
    torch.testing.assert_close(without, with_entropy, atol=0, rtol=0)


def test_padding_does_not_change_valid_log_probs(actor) -> None:
    """Each row scored alone without any padding gives the same log-probs on its valid columns."""
    ids, mask, actions = layout()
    batched, _ = action_log_probs(actor, ids, mask, actions, forward_batch_size=5)
    for i, (prompt, response) in enumerate(ROWS):
        alone = torch.tensor([prompt + response])
        single, _ = action_log_probs(
            actor,
            alone,
            torch.ones_like(alone, dtype=torch.bool),
            len(response),
            forward_batch_size=1,
        )
        torch.testing.assert_close(batched[i, : len(response)], single[0], atol=1e-5, rtol=0)


def test_bfloat16_model_scores_in_float32(tiny_actor_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_actor_dir, dtype=torch.bfloat16).eval()
    ids, mask, actions = layout()
    lp, ent = action_log_probs(
        model, ids, mask, actions, forward_batch_size=2, with_entropy=True, positions_per_chunk=4
    )
    ref_lp, ref_ent = naive_reference(model, ids, mask, actions)  # bf16 logits, f32 math
    assert lp.dtype == torch.float32
    # The logits are bf16 GEMM outputs of other shapes (forward batches of 2, lm_head blocks of
    # 4 positions): on some CPUs (AVX2) their rounding depends on the shape, 5e-4 apart here.
    # The log-softmax in bf16 instead of float32 would be ~3e-2 off: 2e-3 tells the two apart.
    torch.testing.assert_close(lp, ref_lp, atol=2e-3, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=0)


@pytest.mark.parametrize("forward_batch_size", [1, 2, 8])
def test_critic_value_of_column_j_is_read_before_token_j(critic, forward_batch_size: int) -> None:
    ids, mask, actions = layout()
    values = critic_values(critic, ids, mask, actions, forward_batch_size=forward_batch_size)
    assert values.shape == (len(ROWS), actions) and values.dtype == torch.float32
    for i, (prompt, response) in enumerate(ROWS):
        alone = torch.tensor([prompt + response])
        with torch.inference_mode():
            per_token = critic(input_ids=alone).logits[0, :, 0]  # (L,) one value per position
        # Action j is token len(prompt) + j; its value is the state at the position before it.
        expected = per_token[len(prompt) - 1 : len(prompt) - 1 + len(response)]
        torch.testing.assert_close(values[i, : len(response)], expected, atol=1e-5, rtol=0)


def test_last_real_index() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    assert last_real_index(mask).tolist() == [2, 3, 2]


@pytest.mark.parametrize("forward_batch_size", [1, 3, 8])
def test_reward_is_read_at_the_last_real_token(reward, forward_batch_size: int) -> None:
    ids, mask, _ = layout()
    scores = reward_scores(reward, ids, mask, forward_batch_size=forward_batch_size)
    assert scores.shape == (len(ROWS),) and scores.dtype == torch.float32
    for i, (prompt, response) in enumerate(ROWS):
        with torch.inference_mode():  # unpadded row: HF's own pooling reads its last token
            expected = reward(input_ids=torch.tensor([prompt + response])).logits[0, 0]
        torch.testing.assert_close(scores[i], expected, atol=1e-5, rtol=0)
    assert len(set(scores.tolist())) == len(ROWS)  # distinct rows, distinct scores


def test_reward_is_right_when_the_stop_token_equals_pad(tiny_reward_dir: Path) -> None:
    """pad == eos: HF's pooling (last token != pad) would read the token before the stop."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_dir).eval()
    rows = [(p, r + [PAD]) for p, r in ROWS]  # every response ends with the pad id as its EOS
    ids, mask, _ = layout(rows)
    ours = reward_scores(model, ids, mask, forward_batch_size=2)
    with torch.inference_mode():
        hf_pooling = model(input_ids=ids, attention_mask=mask).logits[:, 0]
        model.config.pad_token_id = None  # a single unpadded row is then read at its last token
        expected = torch.stack(
            [model(input_ids=torch.tensor([p + r])).logits[0, 0] for p, r in rows]
        )
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(hf_pooling, expected, atol=1e-4)


def test_reward_without_a_score_head_scores_each_row_unpadded() -> None:
    """A BERT-style classifier (no `score`): per-row forward on the real tokens only."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=1, pad_token_id=PAD,
    )  # fmt: skip
    model = BertForSequenceClassification(config).eval()
    assert not hasattr(model, "score")
    ids, mask, _ = layout()
    scores = reward_scores(model, ids, mask, forward_batch_size=4)
    with torch.inference_mode():
        expected = torch.stack(
            [model(input_ids=torch.tensor([p + r])).logits[0, 0] for p, r in ROWS]
        )
        padded = model(input_ids=ids, attention_mask=mask.long()).logits[:, 0]
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(padded, expected, atol=1e-4)  # padding would have changed them


def test_multi_label_heads_are_a_failed_precondition() -> None:
    from transformers import (
        LlamaConfig,
        LlamaForSequenceClassification,
        LlamaForTokenClassification,
    )

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_labels=2, pad_token_id=PAD,
    )  # fmt: skip
    ids, mask, actions = layout()
    with pytest.raises(FailedPrecondition):
        critic_values(
            LlamaForTokenClassification(config).eval(), ids, mask, actions, forward_batch_size=2
        )
    with pytest.raises(FailedPrecondition):
        reward_scores(
            LlamaForSequenceClassification(config).eval(), ids, mask, forward_batch_size=2
        )


@pytest.mark.parametrize(
    "change",
    [
        {"num_actions": 0},
        {"num_actions": 12},  # == S: no prompt column left to score the first action
        {"forward_batch_size": 0},
        {"temperature": 0.0},
        {"positions_per_chunk": 0},
        {"mask": torch.ones(5, 3, dtype=torch.bool)},
    ],
)
def test_bad_arguments_are_invalid_argument(actor, change: dict) -> None:
    ids, mask, actions = layout()
    kwargs = {"num_actions": actions, "forward_batch_size": 2, "mask": mask, **change}
    with pytest.raises(InvalidArgument):
        action_log_probs(actor, ids, kwargs.pop("mask"), kwargs.pop("num_actions"), **kwargs)


def test_reward_of_an_empty_row_is_invalid_argument(reward) -> None:
    ids, mask, _ = layout()
    mask[1] = False
    with pytest.raises(InvalidArgument):
        reward_scores(reward, ids, mask, forward_batch_size=2)


# ---- lm_head in chunks ---------------------------------------------------------------------------


def test_plain_lm_head_is_applied_in_chunks_and_equals_the_full_head(
    actor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backbone runs once per forward batch; lm_head sees at most positions_per_chunk
    (row, column) pairs at a time, and the result equals lm_head over every position. (The
    position blocks, the CPU's default; tests/test_vocab_chunks.py has the vocabulary chunks.)"""
    from rollserve.server.experience.scoring import _logits_head, lm_head_plan
    from rollserve.server.experience.vocab_chunks import VOCAB_CHUNKS_ENV

    monkeypatch.setenv(VOCAB_CHUNKS_ENV, "0")
    assert _logits_head(actor) is not None
    ids, mask, actions = layout()
    calls: list[int] = []
    hook = actor.get_output_embeddings().register_forward_hook(
        lambda module, args, out: calls.append(out.shape[:-1].numel())
    )
    try:
        lp, ent = action_log_probs(
            actor, ids, mask, actions, forward_batch_size=len(ROWS), with_entropy=True,
            positions_per_chunk=8,
        )  # fmt: skip
    finally:
        hook.remove()
    assert max(calls) <= 8 and sum(calls) == len(ROWS) * actions
    assert len(calls) == lm_head_plan(len(ROWS), actions, 8).blocks
    ref_lp, ref_ent = naive_reference(actor, ids, mask, actions)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)


def test_a_model_that_scales_its_logits_is_scored_through_its_own_logits(
    tiny_actor_dir: Path,
) -> None:
    """Soft-capped or scaled logits (Gemma 2, Cohere, Granite) are not lm_head(hidden): the
    split fails its check and the model's own logits are used, so the numbers stay right."""
    from rollserve.server.experience.scoring import _logits_head
    from transformers import AutoModelForCausalLM

    class ScaledLogits(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.model, self.inner = inner.model, inner
            self.base_model_prefix = "model"

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def forward(self, **kwargs):
            out = self.inner(**kwargs)
            out.logits = 30 * torch.tanh(out.logits / 30)  # Gemma 2's final soft-cap
            return out

    inner = AutoModelForCausalLM.from_pretrained(tiny_actor_dir, dtype=torch.float32).eval()
    model = ScaledLogits(inner).eval()
    assert _logits_head(model) is None
    ids, mask, actions = layout()
    lp, ent = action_log_probs(
        model, ids, mask, actions, forward_batch_size=2, with_entropy=True, positions_per_chunk=3
    )
    ref_lp, ref_ent = naive_reference(model, ids, mask, actions)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)


def test_forward_batches_sort_by_prompt_length_and_trim_shared_left_padding() -> None:
    ids, mask, actions = layout()  # prompts of 5, 2, 4, 1, 3 tokens: first real column 0 3 1 4 2
    plan = forward_batches(ids, mask, 2, actions + 1)
    assert plan.order is not None and plan.order.tolist() == [0, 2, 4, 1, 3]
    # Batches of rows (0, 2), (4, 1), (3): their longest prompts start at columns 0, 2, 4.
    widths = [batch_ids.shape[1] for batch_ids, _ in plan.batches]
    assert widths == [ids.shape[1], ids.shape[1] - 2, ids.shape[1] - 4]
    for (batch_ids, batch_mask), rows in zip(plan.batches, ([0, 2], [4, 1], [3]), strict=True):
        assert torch.equal(batch_ids, ids[rows, -batch_ids.shape[1] :])
        assert torch.equal(batch_mask, mask[rows, -batch_ids.shape[1] :])
    assert torch.equal(plan.restore(ids[plan.order]), ids)
    # A batch of rows whose prompts are all empty keeps the action columns and the one before.
    empty = forward_batches(ids, torch.cat([torch.zeros_like(mask[:, :5]), mask[:, 5:]], 1), 5, 8)
    assert empty.order is None and empty.batches[0][0].shape[1] == 8
    # One batch, already in order: no sort; a group's rows (same prompt) stay together.
    assert forward_batches(ids, mask, 5, actions + 1).order is None
    grouped = forward_batches(ids[[1, 1, 0, 0]], mask[[1, 1, 0, 0]], 2, actions + 1)
    assert grouped.order is not None and grouped.order.tolist() == [2, 3, 0, 1]


@pytest.mark.parametrize("path", ["hf", "rollserve"])
def test_sorted_and_trimmed_forward_batches_score_like_one_batch(
    actor, critic, reward, path: str
) -> None:
    ids, mask, actions = layout()
    whole = dict(forward_batch_size=len(ROWS), path=path)
    small = dict(forward_batch_size=2, path=path)
    for got, want in zip(
        action_log_probs(actor, ids, mask, actions, with_entropy=True, **small),
        action_log_probs(actor, ids, mask, actions, with_entropy=True, **whole),
        strict=True,
    ):
        torch.testing.assert_close(
            got, want
        )  # the right pads' columns too: no left trim reaches them
    values = critic_values(critic, ids, mask, actions, **small)
    torch.testing.assert_close(values, critic_values(critic, ids, mask, actions, **whole))
    scores = reward_scores(reward, ids, mask, **small)
    torch.testing.assert_close(scores, reward_scores(reward, ids, mask, **whole))
