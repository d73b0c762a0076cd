"""Causal attention over rolled rows (server/generation/causal_rows.py) against the masked
attention of the same rows (attention.prefill_mask: HF's rule), on the CPU: the layout, the
attention at every real and right-pad query (plain rows and a group's shared prompt), the
suppression of pad keys in every dtype, and when a forward takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rollserve.server.generation import causal_rows
from rollserve.server.generation.attention import additive_mask, prefill_attention, prefill_mask
from rollserve.server.generation.causal_rows import (
    CAUSAL_MIN_COLUMNS,
    SharedPrompts,
    causal_attention,
    causal_layout,
    causal_work_fits,
    row_runs,
)
from rollserve.server.generation.causal_rows import (
    causal_rows as rows_of,
)

HEADS, KV_HEADS, DIM = 4, 2, 16


def runs(lengths: list[tuple[int, int]], columns: int) -> torch.Tensor:
    """valid (b, columns): row i real from lengths[i][0] (its leading pads) for lengths[i][1]."""
    valid = torch.zeros(len(lengths), columns, dtype=torch.bool)
    for row, (lead, count) in enumerate(lengths):
        valid[row, lead : lead + count] = True
    return valid


def masked_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """The masked attention of rows (b, heads, s, D) under prefill_mask, in float64."""
    mask = additive_mask(prefill_mask(valid.cpu(), None), torch.float64)
    args = (t.double().cpu() for t in (q, k, v))
    return prefill_attention(*args, mask, q.shape[-1] ** -0.5)


def token_major(t: torch.Tensor) -> torch.Tensor:
    """(b, heads, s, D) -> (b * s, heads, D)."""
    return t.transpose(1, 2).reshape(-1, *t.shape[1::2])


def random_rows(b: int, s: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, HEADS, s, DIM, generator=g)
    k, v = (torch.randn(b, KV_HEADS, s, DIM, generator=g) for _ in range(2))
    return q, k, v


def test_the_rolled_rows_hold_each_rows_real_tokens_first_and_are_a_permutation() -> None:
    valid = runs([(3, 5), (0, 10), (7, 3), (0, 4)], 10)
    layout = rows_of(valid, suppress=True)
    flat = layout.to_rows.reshape(-1)
    assert sorted(flat.tolist()) == list(range(40))  # every token once
    position = layout.token_row * 10 + layout.token_column
    assert torch.equal(position[flat], torch.arange(40))  # each token's position inverts it
    counts = valid.sum(-1)
    for row in range(4):
        columns = layout.to_rows[row] - row * 10
        real = valid[row, columns]
        assert real[: counts[row]].all() and not real[counts[row] :].any()
        assert (columns[: counts[row]].diff() == 1).all()  # in order
    assert torch.equal(layout.pads, ~valid.reshape(-1))


def test_a_shared_prompt_is_read_from_its_groups_tokens_in_every_row() -> None:
    width, groups = 4, 2
    valid = runs([(1, 6), (1, 7), (0, 5), (0, 8)], 8)  # groups [0, 1] and [2, 3]
    of_row, first = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 2])
    layout = rows_of(valid, True, SharedPrompts(width, of_row, first))
    head_tokens, rest = groups * width, 8 - width
    for row in range(4):
        expected = [of_row[row] * width + c for c in range(width)]
        expected += [head_tokens + row * rest + c for c in range(rest)]
        lead = int(valid[row].int().argmax())
        rolled = [expected[(t + lead) % 8] for t in range(8)]
        assert layout.to_rows[row].tolist() == [int(t) for t in rolled]
    # Each token's rolled position holds that token; a prompt's in its group's first row.
    position = layout.token_row * 8 + layout.token_column
    assert torch.equal(layout.to_rows.reshape(-1)[position], torch.arange(16 + 8))
    assert layout.token_row[:head_tokens].tolist() == [0] * width + [2] * width


@pytest.mark.parametrize("right_pads", [True, False])
def test_causal_attention_equals_the_masked_one_at_every_real_and_right_pad_query(
    right_pads: bool,
) -> None:
    s = 24
    lengths = [(5, 12), (0, 24), (9, 15), (0, 7), (2, 1)] if right_pads else [(5, 19), (0, 24)]
    valid = runs(lengths, s)
    q, k, v = random_rows(len(lengths), s, seed=1)
    runs_ = row_runs(valid)
    assert runs_.one_run and runs_.right_pads == right_pads
    layout = rows_of(valid, runs_.right_pads)
    out = causal_attention(*(token_major(t) for t in (q, k, v)), layout, DIM**-0.5)
    expected = token_major(masked_reference(q, k, v, valid))
    # Every query but the left pads' (no one reads them).
    first = valid.int().argmax(-1)
    read = (torch.arange(s)[None] >= first[:, None]).reshape(-1)
    torch.testing.assert_close(out[read].double(), expected[read], atol=1e-5, rtol=1e-5)


def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """Record (query heads, key heads, enable_gqa) of every SDPA call from now on."""
    calls: list[tuple[int, int, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        calls.append((q.shape[1], k.shape[1], bool(kwargs.get("enable_gqa", False))))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_causal_attention_reads_the_kv_heads_grouped_not_repeated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The causal route's rows are long: repeating K/V to every query head would be two
    # (rows, heads, columns, D) copies a layer. The grouped call gives the repeat's numbers.
    valid = runs([(5, 12), (0, 24), (9, 15)], 24)
    q, k, v = random_rows(3, 24, seed=4)
    layout = rows_of(valid, suppress=True)
    inputs = [token_major(t) for t in (q, k, v)]
    calls = sdpa_calls(monkeypatch)
    out = causal_attention(*inputs, layout, DIM**-0.5)
    assert calls == [(HEADS, KV_HEADS, True)]
    repeated = [inputs[0], *(t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in inputs[1:])]
    torch.testing.assert_close(out, causal_attention(*repeated, layout, DIM**-0.5))
    assert calls[1] == (HEADS, HEADS, False)  # heads already equal: nothing to group


def test_without_suppression_a_right_pad_query_would_see_the_pads() -> None:
    # The suppression is what makes right-pad queries HF's: a layout that skips it differs.
    valid = runs([(2, 6), (0, 12)], 12)
    q, k, v = random_rows(2, 12, seed=2)
    plain = rows_of(valid, suppress=False)
    out = causal_attention(*(token_major(t) for t in (q, k, v)), plain, DIM**-0.5)
    expected = token_major(masked_reference(q, k, v, valid))
    right_pads = torch.zeros(2, 12, dtype=torch.bool)
    right_pads[0, 8:] = True
    assert not torch.allclose(
        out[right_pads.reshape(-1)].double(), expected[right_pads.reshape(-1)]
    )


def test_shared_prompts_attend_as_each_rows_whole_masked_row() -> None:
    width, rest = 6, 10
    s = width + rest
    # Two groups of two rows; a group's prompt (its lead, its tokens) is the same in its rows.
    valid = runs([(2, 9), (2, 14), (0, 16), (0, 7)], s)
    of_row, first = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 2])
    q, k, v = random_rows(4, s, seed=3)
    for t in (q, k, v):  # the group's rows share the prompt's inputs
        t[1, :, :width] = t[0, :, :width]
        t[3, :, :width] = t[2, :, :width]

    def row_of(t: torch.Tensor) -> torch.Tensor:  # the forward's token row
        tokens = token_major(t).view(4, s, *t.shape[1::2])
        return torch.cat([tokens[first, :width].flatten(0, 1), tokens[:, width:].flatten(0, 1)])

    layout = rows_of(valid, True, SharedPrompts(width, of_row, first))
    out = causal_attention(row_of(q), row_of(k), row_of(v), layout, DIM**-0.5)
    expected = masked_reference(q, k, v, valid)
    head = out[: 2 * width].view(2, width, HEADS, DIM)
    tail = out[2 * width :].view(4, rest, HEADS, DIM)
    whole = torch.cat([head[of_row], tail], dim=1)  # (rows, s, H, D)
    first_real = valid.int().argmax(-1)
    read = torch.arange(s)[None] >= first_real[:, None]
    torch.testing.assert_close(whole[read].double(), expected.transpose(1, 2)[read], atol=1e-5,
                               rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_suppressed_pad_keys_get_no_weight_in_any_dtype(dtype: torch.dtype) -> None:
    # Large scores (q and k scaled up) and a row with one real token: the pad keys must still
    # get exactly no weight, and nothing may overflow (float16's largest is 65,504).
    valid = runs([(0, 1), (3, 4)], 16)
    q, k, v = (t * 4 for t in random_rows(2, 16, seed=4))
    layout = rows_of(valid, suppress=True)
    args = (token_major(t).to(dtype) for t in (q, k, v))
    out = causal_attention(*args, layout, DIM**-0.5)
    assert torch.isfinite(out).all()
    # A right pad of row 0 sees its one real key only: its output is that key's value.
    value = v[0, :, 0].repeat_interleave(HEADS // KV_HEADS, 0).to(dtype)  # (H, D)
    for pad in (1, 5, 15):
        torch.testing.assert_close(out[pad], value)


def test_row_runs_tells_one_run_from_holes_and_empty_rows() -> None:
    assert row_runs(runs([(2, 3), (0, 6)], 6)).one_run
    holes = runs([(0, 6)], 6)
    holes[0, 3] = False  # a masked token inside a row (a pad id among real ones)
    assert not row_runs(holes).one_run
    assert not row_runs(runs([(0, 0), (0, 6)], 6)).one_run  # a row without a real token
    assert row_runs(runs([(0, 5)], 6)).right_pads
    assert not row_runs(runs([(1, 5)], 6)).right_pads  # left pads only: a prefill's prompts


def test_a_forward_attends_causally_only_where_it_pays_and_is_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(causal_rows.CAUSAL_MIN_COLUMNS_ENV, raising=False)
    long = CAUSAL_MIN_COLUMNS
    valid = runs([(3, long - 10), (0, long)], long)
    assert causal_layout(valid, {None}) is not None
    assert causal_layout(valid[:, 1:], {None}) is None  # under CAUSAL_MIN_COLUMNS
    assert causal_layout(valid, {None, long - 1}) is None  # a window the rows pass
    assert causal_layout(valid, {None, long}) is not None  # a window the rows fit
    holes = valid.clone()
    holes[1, 5] = False
    assert causal_layout(holes, {None}) is None
    # Shared prompts: causal when a row's rest is long against its prompt, not when short.
    assert causal_work_fits(rows=64, groups=8, width=128, columns=384)
    assert not causal_work_fits(rows=64, groups=8, width=2048, columns=2048 + 256)
    of_row, first = torch.tensor([0, 1]), torch.tensor([0, 1])
    assert causal_layout(valid, {None}, SharedPrompts(8, of_row, first)) is not None


def test_the_engines_forward_takes_the_causal_route_from_its_threshold(
    monkeypatch: pytest.MonkeyPatch, tiny_actor_dir
) -> None:
    # The threshold is read at each forward; above it the masked route, at it the causal one,
    # and both give the same hidden states at every real column.
    from rollserve.server.generation import scoring_forward
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_actor_dir, dtype=torch.float32).eval()
    forward = scoring_forward(model, "rollserve")
    from rollserve.server.generation import model as generation_model

    calls = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return causal_attention(*args)

    monkeypatch.setattr(generation_model, "causal_attention", counted)
    ids = torch.randint(1, 50, (3, 12))
    mask = runs([(2, 10), (0, 7), (4, 8)], 12).long()
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    hidden = {}
    for least in (13, 12):
        monkeypatch.setenv(causal_rows.CAUSAL_MIN_COLUMNS_ENV, str(least))
        with torch.inference_mode():
            hidden[least] = forward.hidden_states(ids, mask, positions)
    assert len(calls) == model.config.num_hidden_layers  # the second forward only
    first = mask.argmax(-1)
    read = torch.arange(12)[None] >= first[:, None]
    torch.testing.assert_close(hidden[12][read], hidden[13][read], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_on_cuda_causal_attention_runs_on_flash_and_equals_the_masked_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # bfloat16, head_dim 64 (72 with the suppression's dimensions), flash attention the only
    # backend allowed: SDPA raises if flash cannot take these inputs, rather than fall back.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    valid = runs([(5, 40), (0, 64), (20, 30)], 64)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 8, 64, 64, generator=g)
    k, v = (torch.randn(3, 2, 64, 64, generator=g) for _ in range(2))
    layout = rows_of(valid.cuda(), suppress=True)
    inputs = (token_major(t).to("cuda", torch.bfloat16) for t in (q, k, v))
    calls = sdpa_calls(monkeypatch)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = causal_attention(*inputs, layout, 64**-0.5)
    assert calls == [(8, 2, True)]  # flash takes the KV heads grouped: no repeat
    expected = token_major(masked_reference(q, k, v, valid))
    read = (torch.arange(64)[None] >= valid.int().argmax(-1)[:, None]).reshape(-1)
    torch.testing.assert_close(out.cpu()[read].double(), expected[read], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_on_cuda_float32_causal_attention_repeats_the_kv_heads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Flash takes no float32: grouped heads would send SDPA to its math backend (the efficient
    # kernel takes no grouped heads), so the heads are repeated for the efficient kernel.
    valid = runs([(5, 40), (0, 64), (20, 30)], 64)
    q, k, v = random_rows(3, 64, seed=6)
    layout = rows_of(valid.cuda(), suppress=True)
    calls = sdpa_calls(monkeypatch)
    out = causal_attention(*(token_major(t).cuda() for t in (q, k, v)), layout, DIM**-0.5)
    assert calls == [(HEADS, HEADS, False)]
    expected = token_major(masked_reference(q, k, v, valid))
    read = (torch.arange(64)[None] >= valid.int().argmax(-1)[:, None]).reshape(-1)
    torch.testing.assert_close(out.cpu()[read].double(), expected[read], atol=1e-4, rtol=1e-4)


def test_the_threshold_is_the_environments_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    valid = runs([(1, 7), (0, 8)], 8)
    monkeypatch.setenv(causal_rows.CAUSAL_MIN_COLUMNS_ENV, "8")
    assert causal_layout(valid, {None}) is not None
    monkeypatch.setenv(causal_rows.CAUSAL_MIN_COLUMNS_ENV, "9")
    assert causal_layout(valid, {None}) is None
    for bad in ("-1", "many", "1.5"):
        monkeypatch.setenv(causal_rows.CAUSAL_MIN_COLUMNS_ENV, bad)
        with pytest.raises(ValueError, match="ROLLSERVE_CAUSAL_MIN_COLUMNS"):
            causal_layout(valid, {None})
