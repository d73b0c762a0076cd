"""Scoring and prefill of long rows on the engine's forward: causal attention over rolled rows
(causal_rows.py, the default from CAUSAL_MIN_COLUMNS columns on) against the masked attention
the same forward runs for shorter rows, in the same process, repetitions interleaved (the
first of each dropped), medians.

Lanes:
- scoring: `action_log_probs` (path "rollserve") of a GRPO-shaped request, left-padded
  prompts of one length per group and right-padded responses of random lengths: the shared
  prompts' forward (`--samples` > 1) or the plain one (`--samples 1`);
- prefill: `Forward.prefill` of left-padded prompts (what generation runs before decoding).

Prints seconds per lane, masked / causal (above 1.0: causal is faster), and the largest
difference of the log-probs and of the prefill's hidden states between the two. On CUDA, also
the allocator's peak above the start of each lane.

    python bench/bench_long_rows.py                     # CPU, ~2 minutes
    python bench/bench_long_rows.py --prompt-len 64 64 --response-len 300 320   # short rows
    python bench/bench_long_rows.py --device cuda --dtype bfloat16 --hidden 896 --layers 24 \
        --prompts 8 --samples 8 --prompt-len 512 1024 --response-len 2048 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, help="query heads (default hidden / 64)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=(256, 512), metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--response-len", type=int, nargs=2, default=(1024, 2048), metavar=("MIN", "MAX")
    )
    parser.add_argument("--reps", type=int, default=3)
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A random Qwen2-shaped causal LM (no download), as a server loads it (no grad, eval)."""
    import transformers as tf

    torch.manual_seed(0)
    heads = args.heads or max(2, args.hidden // 64)
    config = tf.Qwen2Config(
        hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=2,
        vocab_size=args.vocab,
        max_position_embeddings=args.prompt_len[1] + args.response_len[1] + 1,
    )  # fmt: skip
    model = tf.Qwen2ForCausalLM(config).eval().requires_grad_(False)
    return model.to(args.device, getattr(torch, args.dtype))


def request(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Sequences and mask (B, P + A) of left-padded prompts (a group's rows share theirs) and
    right-padded responses of random lengths; A and P."""
    g = torch.Generator().manual_seed(1)
    width, actions = args.prompt_len[1], args.response_len[1]
    rows = args.prompts * args.samples
    sequences = torch.randint(1, args.vocab, (rows, width + actions), generator=g)
    mask = torch.zeros_like(sequences)
    for prompt in range(args.prompts):
        length = int(torch.randint(args.prompt_len[0], width + 1, (1,), generator=g))
        group = slice(prompt * args.samples, (prompt + 1) * args.samples)
        sequences[group, :width] = sequences[group.start, :width].clone()
        mask[group, width - length : width] = 1
        for row in range(group.start, group.stop):
            response = int(torch.randint(args.response_len[0], actions + 1, (1,), generator=g))
            mask[row, width : width + response] = 1
    sequences[mask == 0] = 0
    return sequences.to(args.device), mask.to(args.device), actions, width


def timed(
    call: Callable[[], torch.Tensor], device: torch.device
) -> tuple[float, torch.Tensor, int]:
    """Seconds, result and (CUDA) allocator peak above the start of one call."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    out = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - start_bytes if device.type == "cuda" else 0
    return seconds, out, peak


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rollserve.server.experience.scoring import action_log_probs
    from rollserve.server.generation import causal_rows, scoring_forward

    device = torch.device(args.device)
    model = build_model(args)
    sequences, mask, actions, width = request(args)
    forward = scoring_forward(model, "rollserve")
    assert forward is not None
    rows = sequences.shape[0]
    prompts, prompt_mask = sequences[:, :width], mask[:, :width].bool()
    prompt_positions = (prompt_mask.long().cumsum(-1) - 1).clamp_min(0)
    threshold = os.environ.get(causal_rows.CAUSAL_MIN_COLUMNS_ENV) or causal_rows.CAUSAL_MIN_COLUMNS
    print(f"# {args.layers}-layer Qwen2 hidden {args.hidden}, {args.dtype} on {device}; "
          f"{args.prompts} prompts x {args.samples} samples, prompt {width} columns, "
          f"responses {args.response_len[0]}-{actions}; causal from "
          f"{threshold} columns; {args.reps} reps after 1")  # fmt: skip
    lanes: dict[str, Callable[[], torch.Tensor]] = {
        "scoring": lambda: action_log_probs(model, sequences, mask, actions,
                                            forward_batch_size=rows, path="rollserve")[0],
        "prefill": lambda: forward.prefill(prompts, prompt_mask, prompt_positions, None),
    }  # fmt: skip
    from rollserve.server.generation import model as generation_model

    causal_calls = [0]  # causal attentions of a lane's call: proof of the route it took
    causal = generation_model.causal_attention

    def counted(*call_args: object) -> torch.Tensor:
        causal_calls[0] += 1
        return causal(*call_args)

    generation_model.causal_attention = counted
    calls: dict[tuple[str, str], int] = {}
    set_before = os.environ.get(causal_rows.CAUSAL_MIN_COLUMNS_ENV)
    modes = {"causal": 0, "masked": 1 << 30}
    seconds: dict[tuple[str, str], list[float]] = {}
    peaks: dict[tuple[str, str], int] = {}
    outputs: dict[tuple[str, str], torch.Tensor] = {}
    with torch.inference_mode():
        for rep in range(args.reps + 1):
            for lane, call in lanes.items():
                for mode, least in modes.items():
                    os.environ[causal_rows.CAUSAL_MIN_COLUMNS_ENV] = str(least)
                    causal_calls[0] = 0
                    spent, out, peak = timed(call, device)
                    calls[lane, mode] = causal_calls[0]
                    outputs[lane, mode], peaks[lane, mode] = out, peak
                    if rep:
                        seconds.setdefault((lane, mode), []).append(spent)
    if set_before is None:
        os.environ.pop(causal_rows.CAUSAL_MIN_COLUMNS_ENV)
    else:
        os.environ[causal_rows.CAUSAL_MIN_COLUMNS_ENV] = set_before
    generation_model.causal_attention = causal
    print("\n| lane | attention | seconds (median) | min | causal attention calls | "
          "CUDA peak above start GiB |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for (lane, mode), values in seconds.items():
        peak = f"{peaks[lane, mode] / 2**30:.2f}" if device.type == "cuda" else "-"
        print(f"| {lane} | {mode} | {statistics.median(values):.3f} | {min(values):.3f} | "
              f"{calls[lane, mode]} | {peak} |")  # fmt: skip
    for lane in lanes:
        ratio = statistics.median(seconds[lane, "masked"]) / statistics.median(
            seconds[lane, "causal"]
        )
        # Every action column (the right pads' too: causal_rows suppresses pad keys so that a
        # pad query sees what it sees under the mask); the prompts' real tokens (a left pad's
        # output is no one's input).
        compared = torch.ones_like(outputs[lane, "causal"], dtype=torch.bool)
        if lane == "prefill":
            compared = prompt_mask
        diff = (outputs[lane, "causal"] - outputs[lane, "masked"]).float().abs()[compared].max()
        print(f"{lane}: masked / causal {ratio:.2f}; largest difference {float(diff):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
