"""Peak memory of chunked action_log_probs divided by a naive full float32 log-softmax.

The naive baseline is what many RLHF codebases do: logits for every position (B, S, V), a float32
log_softmax over all of it, then gather the action columns. rollserve's action_log_probs runs
forward_batch_size rows through the backbone at a time and applies lm_head, then the float32
math, to positions_per_chunk (row, column) pairs at a time. It is measured at every forward
batch size given (0 = the whole batch in one forward), each against the same naive runs.

Each measurement runs in a fresh subprocess (the variants must not share an allocator's
high-water mark), after the model is built and one small warm-up forward ran:
  * CPU: the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) minus the RSS
    before scoring; falls back to ru_maxrss when the reset is not allowed.
  * CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() before scoring.
Repetitions rotate the order of the variants. The ratio of medians per forward batch size is
the headline, target <= 0.25 at every one.

    python bench/bench_scoring_memory.py                   # CPU, B 8, S 1024, V 32k: ~2 minutes
    python bench/bench_scoring_memory.py --forward-batch-sizes 0 --entropy
    python bench/bench_scoring_memory.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument(
        "--forward-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 0],
        help="rows per forward to measure; 0: the whole batch",
    )  # fmt: skip
    parser.add_argument("--positions-per-chunk", type=int, default=512)
    parser.add_argument("--entropy", action="store_true", help="also compute entropy (both)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # child: naive | chunked
    return parser.parse_args(argv)


def build(args: argparse.Namespace):
    """The model and a left-padded batch with A action columns, identical in every process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.prompt_len + args.response_len, pad_token_id=0,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    width = args.prompt_len + args.response_len
    ids = torch.randint(1, args.vocab, (args.batch, width))
    mask = torch.ones((args.batch, width), dtype=torch.bool)
    for row in range(args.batch):  # left pads of different widths, right pads after responses
        mask[row, : row * args.prompt_len // (2 * args.batch)] = False
        mask[row, width - row * args.response_len // (2 * args.batch) :] = False
    ids[~mask] = 0
    return model, ids.to(args.device), mask.to(args.device)


def naive(model, ids: torch.Tensor, mask: torch.Tensor, actions: int, entropy: bool):
    from rollserve.server.experience.scoring import position_ids_from_mask

    with torch.inference_mode():
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
        ).logits
        log_soft = torch.log_softmax(logits.float(), dim=-1)  # (B, S, V) float32
        log_probs = log_soft[:, -actions - 1 : -1].gather(-1, ids[:, -actions:, None]).squeeze(-1)
        if entropy:
            _ = -(log_soft[:, -actions - 1 : -1].exp() * log_soft[:, -actions - 1 : -1]).sum(-1)
    return log_probs


def chunked(model, ids, mask, actions: int, entropy: bool, batch_size: int, per_chunk: int):
    from rollserve.server.experience.scoring import action_log_probs

    log_probs, _ = action_log_probs(
        model, ids, mask, actions, forward_batch_size=batch_size, with_entropy=entropy,
        positions_per_chunk=per_chunk,
    )  # fmt: skip
    return log_probs


def resident_kib() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process in KiB, from /proc/self/status."""
    status = Path("/proc/self/status").read_text()
    current = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    peak = int(re.search(r"VmHWM:\s+(\d+)", status).group(1))
    return current, peak


def measure(args: argparse.Namespace) -> dict:
    """Child process: build, warm up, reset the peak, score once, report the peak increase."""
    model, ids, mask = build(args)
    with torch.inference_mode():  # warm-up: thread pools and kernels, not counted
        model(input_ids=ids[:1, :16], attention_mask=mask[:1, :16])
    actions = args.response_len
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            before, method = resident_kib()[0] * 1024, "VmHWM"
        except OSError:
            before, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"
    if args.variant == "naive":
        log_probs = naive(model, ids, mask, actions, args.entropy)
    else:
        batch_size = args.forward_batch_sizes[0] or args.batch
        log_probs = chunked(
            model, ids, mask, actions, args.entropy, batch_size, args.positions_per_chunk
        )
    if cuda:
        torch.cuda.synchronize()
        peak, method = torch.cuda.max_memory_allocated(), "cuda.max_memory_allocated"
    elif method == "VmHWM":
        peak = resident_kib()[1] * 1024
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    valid = log_probs[mask[:, -actions:]]
    return {"peak_bytes": peak - before, "method": method, "checksum": float(valid.double().sum())}


def run_child(variant: str, argv: list[str]) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--variant", variant]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available: skipping the GPU benchmark.")
        return 0
    if args.variant:
        print(json.dumps(measure(args)))
        return 0
    # One lane per variant; the last --forward-batch-sizes on a child's command line wins.
    lanes = {"naive": [*argv, "--forward-batch-sizes", "0"]}
    for size in args.forward_batch_sizes:
        lanes[f"fbs={size or args.batch}"] = [*argv, "--forward-batch-sizes", str(size)]
    results: dict[str, list[dict]] = {lane: [] for lane in lanes}
    for rep in range(args.reps):
        order = list(lanes)
        order = order[rep % len(order) :] + order[: rep % len(order)]  # rotate the order
        for lane in order:
            variant = "naive" if lane == "naive" else "chunked"
            results[lane].append(run_child(variant, lanes[lane]))
    peaks = {lane: statistics.median(r["peak_bytes"] for r in rs) for lane, rs in results.items()}
    mib = 1 << 20
    width = args.prompt_len + args.response_len
    print(
        f"device={args.device} dtype={args.dtype} B={args.batch} S={width} A={args.response_len} "
        f"V={args.vocab} positions_per_chunk={args.positions_per_chunk} entropy={args.entropy} "
        f"method={results['naive'][0]['method']} reps={args.reps}"
    )
    print(f"full float32 (B, S, V) tensor = {args.batch * width * args.vocab * 4 / mib:.0f} MiB")
    for lane, rs in results.items():
        peaks_mib = " ".join(f"{r['peak_bytes'] / mib:.0f}" for r in rs)
        print(f"{lane:8s} peak MiB per rep: {peaks_mib}   checksum {rs[0]['checksum']:.4f}")
    worst = 0.0
    for lane in results:
        if lane != "naive":
            ratio = peaks[lane] / peaks["naive"]
            worst = max(worst, ratio)
            print(f"ratio chunked/naive {lane:8s} = {ratio:.3f}")
    print(f"worst ratio chunked/naive = {worst:.3f} (target <= 0.25 at every forward batch size)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
