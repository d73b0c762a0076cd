"""Scoring a padded request: sorted and trimmed forward batches against plain ones, and the peak
memory of a full-sequence forward with its MLP in token chunks and its attention mask in blocks
of queries, each against the same forward with that part whole.

1. Time. `action_log_probs` of a GRPO-shaped request whose prompts and responses vary in length
   (left-padded prompts, right-padded responses), with `scoring.forward_batches` as it is (rows
   longest prompt first, each forward batch without its all-padding leading columns) against
   plain batches in the caller's order without trimming (the old plan), in the same process,
   repetitions interleaved, the first of each dropped. Prints the ratio of medians
   (plain / sorted+trimmed) and the largest difference of the log-probs.
2. Memory (--memory). `Forward.hidden_states` of one forward batch on the masked route as it
   is ("bounded") against one MLP chunk of every token ("MLP whole"), against one attention mask
   of every query ("mask whole": attention.MASK_BYTES unbounded) and against the causal route
   ("causal": causal_rows.py, no mask), each in a fresh subprocess: peak RSS above
   the RSS before the forward (VmHWM after a reset through /proc/self/clear_refs, Linux; on
   CUDA the allocator's peak above what was allocated before), and the forward's seconds.

    python bench/bench_scoring_padding.py                       # CPU, ~1 minute; both paths
    python bench/bench_scoring_padding.py --memory              # + the MLP chunking's peak
    python bench/bench_scoring_padding.py --memory --paths hf --forward-batch 64 --hidden 896 \
        --intermediate 4864 --layers 2 --reps 2                 # the 0.5B model's MLP width
    python bench/bench_scoring_padding.py --memory --paths hf --prompts 4 --samples 1 \
        --prompt-len 2048 2048 --response-len 4096 4096 --forward-batch 4 --hidden 64 \
        --layers 2 --vocab 256 --reps 1            # long rows: the attention mask's bound
    python bench/bench_scoring_padding.py --device cuda --dtype bfloat16 --layers 24 --hidden 896
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, help="MLP width (default 11/4 x hidden)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--response-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX")
    )
    parser.add_argument("--forward-batch", type=int, default=16)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--paths", default="hf,rollserve")
    parser.add_argument("--memory", action="store_true", help="also the MLP chunking's peak")
    parser.add_argument("--peak-of", choices=PEAK_LANES, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A random Qwen2-shaped causal LM (no download), as a server loads it (no grad, eval)."""
    import transformers as tf

    torch.manual_seed(0)
    heads = max(2, args.hidden // 64)
    config = tf.Qwen2Config(
        hidden_size=args.hidden, intermediate_size=args.intermediate or args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=2,
        vocab_size=args.vocab,
        max_position_embeddings=max(2048, args.prompt_len[1] + args.response_len[1]),
    )  # fmt: skip
    model = tf.Qwen2ForCausalLM(config).eval().requires_grad_(False)
    return model.to(args.device, getattr(torch, args.dtype))


def padded_request(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Sequences and mask (B, P + A) of left-padded prompts (a group's rows share theirs) and
    right-padded responses of random lengths, and A."""
    g = torch.Generator().manual_seed(1)
    rows = args.prompts * args.samples
    width, actions = args.prompt_len[1], args.response_len[1]
    prompt_lens = torch.randint(args.prompt_len[0], width + 1, (args.prompts,), generator=g)
    prompt_lens = prompt_lens.repeat_interleave(args.samples)
    response_lens = torch.randint(args.response_len[0], actions + 1, (rows,), generator=g)
    ids = torch.randint(1, args.vocab, (rows, width + actions), generator=g)
    mask = torch.zeros(rows, width + actions, dtype=torch.bool)
    for row in range(rows):
        mask[row, width - int(prompt_lens[row]) : width + int(response_lens[row])] = True
    ids[~mask] = 0
    return ids.to(args.device), mask.to(args.device), actions


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_lanes(args: argparse.Namespace) -> None:
    from rollserve.server.experience import scoring

    model = build_model(args)
    ids, mask, actions = padded_request(args)
    print(
        f"# {ids.shape[0]} rows x ({ids.shape[1] - actions} + {actions}) columns, "
        f"{float(mask.float().mean()):.0%} real; h{args.hidden} x {args.layers} layers, "
        f"vocab {args.vocab}, {args.dtype} on {args.device}; forward batch {args.forward_batch}"
    )
    planned = scoring.forward_batches

    def plain(sequences, attention_mask, batch_size, keep_last):  # noqa: ANN001, ARG001
        batches = tuple(
            (sequences[start : start + batch_size], attention_mask[start : start + batch_size])
            for start in range(0, sequences.shape[0], batch_size)
        )
        return scoring.ForwardBatches(batches, None)

    for path in args.paths.split(","):
        seconds: dict[str, list[float]] = {"plain": [], "sorted+trimmed": []}
        out: dict[str, torch.Tensor] = {}
        lanes = [("plain", plain), ("sorted+trimmed", planned)]
        try:
            for rep in range(args.reps):
                for name, plan in lanes if rep % 2 else lanes[::-1]:
                    scoring.forward_batches = plan
                    sync(args.device)
                    start = time.perf_counter()
                    out[name], _ = scoring.action_log_probs(
                        model, ids, mask, actions, forward_batch_size=args.forward_batch, path=path
                    )
                    sync(args.device)
                    seconds[name].append(time.perf_counter() - start)
        finally:
            scoring.forward_batches = planned
        medians = {name: statistics.median(times[1:] or times) for name, times in seconds.items()}
        real = mask[:, -actions:]
        diff = float((out["plain"] - out["sorted+trimmed"])[real].abs().max())
        print(
            f"path {path}: plain {medians['plain']:.3f} s, sorted+trimmed "
            f"{medians['sorted+trimmed']:.3f} s (per rep: "
            f"{' '.join(f'{t:.2f}' for t in seconds['plain'])} / "
            f"{' '.join(f'{t:.2f}' for t in seconds['sorted+trimmed'])}); "
            f"ratio plain/sorted+trimmed = {medians['plain'] / medians['sorted+trimmed']:.2f}; "
            f"max |diff| {diff:.1e}",
            flush=True,
        )


# The memory lanes: the masked forward as it is, with its MLP in one chunk, with its mask
# whole (each on the masked route: ROLLSERVE_CAUSAL_MIN_COLUMNS past any row), and the causal
# route (the variable at 0: causal_rows.py, no mask at all; the default from its threshold on).
PEAK_LANES = ("bounded", "MLP whole", "mask whole", "causal")


def peak_of(args: argparse.Namespace) -> None:
    """In this (fresh) process: the peak RSS above start of one forward batch's hidden states,
    and its seconds."""
    from rollserve.server.experience.scoring import position_ids_from_mask
    from rollserve.server.generation import attention, scoring_forward
    from rollserve.server.generation import model as generation_model
    from rollserve.server.generation.causal_rows import CAUSAL_MIN_COLUMNS_ENV

    os.environ[CAUSAL_MIN_COLUMNS_ENV] = "0" if args.peak_of == "causal" else str(1 << 62)
    if args.peak_of == "MLP whole":  # one call of one chunk a layer
        generation_model.MLP_CHUNK_TOKENS = 1 << 62
        generation_model.MLP_CALL_CHUNKS = 1
    if args.peak_of == "mask whole":
        attention.MASK_BYTES = 1 << 62
    model = build_model(args)
    ids, mask, actions = padded_request(args)
    ids, mask = ids[: args.forward_batch], mask[: args.forward_batch]
    forward = scoring_forward(model, "rollserve")
    assert forward is not None
    positions = position_ids_from_mask(mask)
    on_cuda = args.device.startswith("cuda")
    with torch.inference_mode():
        forward.hidden_states(ids[:1], mask[:1], positions[:1])  # warm
        sync(args.device)
        if on_cuda:  # the device's allocator peak
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
            before = _rss_bytes()
        started = time.perf_counter()
        forward.hidden_states(ids, mask, positions, ids.shape[1] - actions)
        sync(args.device)
        seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if on_cuda else _status_bytes("VmHWM")
    print(f"{(peak - before) / 2**20:.0f} {seconds:.3f}")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_lanes(args: argparse.Namespace, argv: list[str]) -> None:
    from rollserve.server.generation.attention import MASK_BYTES
    from rollserve.server.generation.model import MLP_CALL_CHUNKS, MLP_CHUNK_TOKENS

    peaks, seconds = {}, {}
    for lane in PEAK_LANES:
        done = subprocess.run(
            [sys.executable, __file__, *argv, "--peak-of", lane],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        peak, took = done.stdout.split()[-2:]
        peaks[lane], seconds[lane] = float(peak), float(took)
    rows, width = args.forward_batch, args.prompt_len[1] + args.response_len[1]
    print(
        f"hidden_states of one forward batch ({rows} rows x {width} columns): peak above "
        f"start / seconds: bounded (MLP in chunks of {MLP_CHUNK_TOKENS} tokens or fewer, "
        f"{MLP_CALL_CHUNKS} a call; attention mask within {MASK_BYTES >> 20} MiB) "
        f"{peaks['bounded']:.0f} MiB / {seconds['bounded']:.2f} s, MLP at once "
        f"{peaks['MLP whole']:.0f} MiB / {seconds['MLP whole']:.2f} s, mask whole "
        f"{peaks['mask whole']:.0f} MiB / {seconds['mask whole']:.2f} s; ratios bounded / MLP "
        f"whole = {_ratio(peaks['bounded'], peaks['MLP whole'])}, bounded / mask whole = "
        f"{_ratio(peaks['bounded'], peaks['mask whole'])}; causal attention (no mask) "
        f"{peaks['causal']:.0f} MiB / {seconds['causal']:.2f} s, causal / bounded = "
        f"{_ratio(peaks['causal'], peaks['bounded'])}"
    )


def _ratio(part: float, whole: float) -> str:
    """part / whole to 2 decimals; "-" where whole is 0 MiB (a forward too small to show)."""
    return f"{part / whole:.2f}" if whole > 0 else "-"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.peak_of:
        peak_of(args)
        return
    time_lanes(args)
    if args.memory:
        memory_lanes(args, [a for a in argv if a != "--memory"])


if __name__ == "__main__":
    main()
