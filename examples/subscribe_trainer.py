"""A minimal trainer that subscribes to a server's continuous rollout.

    rollserve serve --rollout-prompts prompts.jsonl --rollout-request request.json &
    python examples/subscribe_trainer.py --target 127.0.0.1:50051 --name trainer-a
    python examples/subscribe_trainer.py --target 127.0.0.1:50051 --name trainer-b \\
        --weights actor/model.safetensors --push-every 2

Each batch the server deals to this trainer becomes one JSON line (on stdout, or appended to
--out, flushed at once): its batch_index, epoch, step, the prompt ids of its rows and their
policy versions. Several copies share one rollout round-robin. A real trainer would train on
each batch and push its new weights; this one stands in for it: with --weights it pushes that
safetensors file back every --push-every batches, with the server's version + 1 (another
trainer may push too, so it reads the version first and retries once on a conflict).

--kill-after N ends the process with SIGKILL right after recording its N-th batch: a trainer
that crashes mid-stream (tests use it; the batches not yet sent go to the other trainers).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import TextIO

from rollserve.client import FailedPrecondition, RolloutClient
from rollserve.client.calls import SubscribedBatch


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="HOST:PORT of the rollserve server")
    parser.add_argument("--name", default="", help="subscriber id in the server's logs")
    parser.add_argument("--out", help="append one JSON line per batch here (default: stdout)")
    parser.add_argument("--max-batches", type=int, default=0, help="stop after N; 0: no limit")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="deadline of the stream")
    parser.add_argument("--weights", help="safetensors file of the actor to push back")
    parser.add_argument("--push-every", type=int, default=0, help="push every N batches; 0: never")
    parser.add_argument("--kill-after", type=int, default=0, help="SIGKILL self after N batches")
    args = parser.parse_args(argv)
    if args.push_every and not args.weights:
        parser.error("--push-every needs --weights")
    return args


def record(batch: SubscribedBatch, name: str, out: TextIO) -> None:
    """One JSON line per batch, flushed so that a killed process leaves every line whole."""
    line = {
        "subscriber": name,
        "batch_index": batch.batch_index,
        "epoch": batch.epoch,
        "step": batch.step,
        "prompt_ids": batch.experience.prompt_index.tolist(),
        "policy_versions": batch.experience.policy_version.tolist(),
    }
    out.write(json.dumps(line) + "\n")
    out.flush()


def push_weights(client: RolloutClient, weights_path: str) -> int:
    """Push the weights with the server's version + 1; returns the version now serving."""
    from safetensors.torch import load_file

    weights = load_file(weights_path)
    for _ in range(2):  # another trainer may take the same version first
        version = client.health().policy_version + 1
        try:
            return client.update_weights(weights, version=version).version
        except FailedPrecondition:
            continue
    raise RuntimeError("could not push weights: the version kept moving")


def run(args: argparse.Namespace, out: TextIO) -> int:
    received = 0
    with RolloutClient(args.target, timeout_s=60.0) as client:
        stream = client.subscribe(args.name, args.max_batches, timeout_s=args.timeout_s)
        for batch in stream:
            record(batch, args.name, out)
            received += 1
            if args.kill_after and received >= args.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: no clean-up, no goodbye
            if args.push_every and received % args.push_every == 0:
                push_weights(client, args.weights)
    print(f"{args.name or 'subscriber'}: {received} batches", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.out is None:
        return run(args, sys.stdout)
    with open(args.out, "a", encoding="utf-8") as out:
        return run(args, out)


if __name__ == "__main__":
    sys.exit(main())
