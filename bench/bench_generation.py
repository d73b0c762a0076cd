"""Tokens/s of rollserve's generate() divided by Hugging Face model.generate() on the same model.

Both sample with the same temperature / top-k / top-p, batch, prompts and budget, from a random
Llama (or a 0.5B-class Qwen2 with --model-size 0.5b) built from a config: no download. The batch
is GRPO-shaped: batch / samples_per_prompt distinct prompts, each repeated samples_per_prompt
times consecutively; HF gets the same repeated rows (what its num_return_sequences does before
its prefill), rollserve prefills each distinct prompt once and copies its KV cache to the group.
The model has no EOS, so both produce exactly batch * new_tokens tokens per call. Repetitions
are interleaved (and their order alternated) because the machine is noisy; the ratio of
medians is the headline, target >= 2.0 with 8 samples per prompt and 256-token prompts.

    python bench/bench_generation.py                      # CPU, ~2 minutes on 2 cores
    python bench/bench_generation.py --samples-per-prompt 1 --prompt-len 64   # no sharing
    python bench/bench_generation.py --device cuda --dtype bfloat16 --model-size 0.5b
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from rollserve.server.experience.generation import SamplingParams, generate, left_pad


def build_model(size: str, vocab: int, hidden: int, layers: int, dtype: torch.dtype, device: str):
    """A random causal LM from a config: a small Llama, or a Qwen2-0.5B-shaped model."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(pad_token_id=0, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    if size == "0.5b":
        config = Qwen2Config(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
            **common,
        )  # fmt: skip
        model = Qwen2ForCausalLM(config)
    else:
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
            num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
            num_key_value_heads=max(1, hidden // 128), max_position_embeddings=4096, **common,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model.to(device=device, dtype=dtype).eval()


def grouped_prompts(
    batch: int, samples: int, min_len: int, max_len: int, vocab: int, seed: int
) -> list[list[int]]:
    """batch / samples distinct prompts of lengths in [min_len, max_len], each repeated
    `samples` times consecutively (a GRPO group); ragged lengths exercise left padding."""
    if batch % samples:
        raise SystemExit(f"--batch ({batch}) must be a multiple of --samples-per-prompt")
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch // samples,), generator=g)
    distinct = [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in lengths]
    return [p for p in distinct for _ in range(samples)]


def timed(fn: Callable[[], int], device: str) -> tuple[float, int]:
    """Seconds and tokens of one call, synchronising the device around it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--model-size", default="small", choices=["small", "0.5b"])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="rows per call")
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256, help="longest prompt")
    parser.add_argument("--min-prompt-len", type=int, default=0, help="0: prompt-len * 3 / 4")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available: skipping the GPU benchmark.")
        return 0

    model = build_model(
        args.model_size,
        args.vocab,
        args.hidden,
        args.layers,
        getattr(torch, args.dtype),
        args.device,
    )
    vocab = model.config.vocab_size
    min_len = args.min_prompt_len or max(1, args.prompt_len * 3 // 4)
    prompts = grouped_prompts(
        args.batch, args.samples_per_prompt, min_len, args.prompt_len, vocab, seed=1
    )
    ids, mask = left_pad(prompts, 0, torch.device(args.device))
    params = SamplingParams(
        max_new_tokens=args.new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p,
    )  # fmt: skip

    def ours() -> int:
        g = torch.Generator(device=args.device).manual_seed(0)
        out = generate(model, prompts, params, pad_token_id=0, generator=g)
        return int(out.response_lengths.sum())

    # HF's defaults (top_k=50) must not leak in: pass every setting, greedy as do_sample=False.
    sampling = {"do_sample": False}
    if args.temperature > 0:
        sampling = {
            "do_sample": True, "temperature": args.temperature, "top_k": args.top_k,
            "top_p": args.top_p,
        }  # fmt: skip

    def hf() -> int:
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask.long(), max_new_tokens=args.new_tokens,
                pad_token_id=0, **sampling,
            )  # fmt: skip
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    for fn in (ours, hf):  # warm-up: allocator, kernels, lazy imports
        fn()
    rates: dict[str, list[float]] = {"ours": [], "hf": []}
    for rep in range(args.reps):
        order = [("ours", ours), ("hf", hf)] if rep % 2 == 0 else [("hf", hf), ("ours", ours)]
        for name, fn in order:
            seconds, tokens = timed(fn, args.device)
            rates[name].append(tokens / seconds)
    ours_rate, hf_rate = statistics.median(rates["ours"]), statistics.median(rates["hf"])
    print(
        f"model={args.model_size} device={args.device} dtype={args.dtype} vocab={vocab} "
        f"batch={args.batch} samples_per_prompt={args.samples_per_prompt} "
        f"prompt_len={min_len}..{args.prompt_len} new_tokens={args.new_tokens} "
        f"T={args.temperature} top_k={args.top_k} top_p={args.top_p} reps={args.reps} "
        f"threads={torch.get_num_threads()}"
    )
    print("per-rep tokens/s ours:", " ".join(f"{r:.0f}" for r in rates["ours"]))
    print("per-rep tokens/s hf:  ", " ".join(f"{r:.0f}" for r in rates["hf"]))
    print(f"median tokens/s: ours {ours_rate:.0f}, hf.generate {hf_rate:.0f}")
    print(f"ratio ours/hf = {ours_rate / hf_rate:.3f} (target >= 2.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
