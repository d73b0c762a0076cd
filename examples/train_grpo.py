"""An example GRPO trainer that really learns through a rollserve server.

    python examples/train_grpo.py                       # spawns a local server, trains, plots
    python examples/train_grpo.py --target HOST:PORT    # uses a running server (any flags)

Task: prompts such as "x=" whose ground-truth answer is "7", rewarded by the server's built-in
`numeric_match` rule (1 when the last number in the response equals the answer). Every server
offers that rule, so `--target` works against a default `rollserve serve` with no extra flags.
The random tiny byte-level Llama starts near 5% (a digit run that is exactly "7" and no digit
after it, by chance) and learns to answer 7 within a few dozen steps on a CPU.

Loop per step: MakeExperience (GRPO groups, `group_norm` advantages, KL returned for the loss)
-> a few clipped-policy-loss epochs on this trainer's own copy of the policy -> UpdateWeights
with version + 1, so the next rollout is made by the new weights (checked on every row).
See examples/README.md for the choices and the flags.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from grpo_loss import grpo_loss, policy_log_probs
from rollserve.client import (
    Experience,
    ExperienceBuffer,
    FailedPrecondition,
    RolloutClient,
    WeightsGroup,
    mean_kl,
)
from server_process import LocalServer

# Distinct prompts so a step has several GRPO groups; all share the answer.
PROMPTS = ("x=", "a=", "n=", "y=", "answer=", "k=", "value: ", "result=")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run depends on (the CLI flags)."""

    out_dir: Path
    target: str | None = None  # None: spawn a local server
    steps: int = 60
    seed: int = 0
    lr: float = 3e-3
    prompts_per_step: int = 8
    samples_per_prompt: int = 8  # GRPO group size
    max_new_tokens: int = 16
    temperature: float = 1.0
    ppo_epochs: int = 2
    mini_batch_rows: int = 32
    clip_eps: float = 0.2
    kl_coef: float = 0.01  # k3 KL to the reference in the loss; 0 disables
    answer: str = "7"
    reward: str = "numeric_match"
    actor: str | None = None  # None: the built-in tiny Llama (what a default server serves)
    device: str = "cpu"
    plot: bool = True
    timeout_s: float = 120.0
    # How weights reach the server: auto (shared memory on the same host, else gRPC), grpc,
    # shm, or dist (a torch.distributed broadcast through a WeightsGroup).
    transport: str = "auto"
    streams: int = 0  # parallel gRPC streams for grpc/auto; 0: one per 4 cores


@dataclass(frozen=True)
class StepStats:
    """One step's numbers, as printed and written to curve.csv / curve.json."""

    step: int
    policy_version: int  # version that made this step's rollout
    reward_mean: float  # raw reward of the recipe's source, over all rows
    kl: float  # mean per-row KL of the rollout policy to the reference (server's estimate)
    response_length: float  # mean valid response tokens
    policy_loss: float
    clip_fraction: float
    rollout_s: float
    train_s: float
    update_s: float


def load_policy(config: TrainConfig) -> torch.nn.Module:
    """The trainer's own policy: `--actor DIR`, or the built-in tiny Llama the server starts from
    (same spec and seed, so same weights) saved under the output folder."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the per-step log readable
    actor_dir = config.actor
    if actor_dir is None:
        from rollserve.server.models.default_model import save_tiny_causal_lm

        actor_dir = str(save_tiny_causal_lm(config.out_dir / "initial_actor"))
    model = AutoModelForCausalLM.from_pretrained(actor_dir, dtype=torch.float32)
    return model.to(config.device).train()


def sync_server(client: RolloutClient, policy: torch.nn.Module) -> int:
    """Wait for the server and check it serves our vocabulary; returns its current version.

    A running server may have been trained before (version > 0): the first push goes one
    version above it, so any run starts from the same place.
    """
    health = client.wait_until_ready()
    vocab = policy.get_output_embeddings().weight.shape[0]
    if health.vocab_size != vocab:
        raise FailedPrecondition(
            f"server actor has vocab {health.vocab_size}, the trainer's {vocab}: pass the "
            "server's actor directory with --actor"
        )
    return health.policy_version


class WeightPusher:
    """Pushes the policy over the configured transport (a WeightsGroup for "dist")."""

    def __init__(self, client: RolloutClient, config: TrainConfig) -> None:
        self._client = client
        self._options: dict[str, object] = {"transport": config.transport}
        if config.streams:
            self._options["streams"] = config.streams
        self._group = WeightsGroup([client]) if config.transport == "dist" else None
        if self._group is not None:
            self._options = {"transport": "dist", "group": self._group}
        self._flattened: torch.nn.Module | None = None

    def push(self, policy: torch.nn.Module, version: int) -> int:
        """Send the policy as `version`; the version the server now serves."""
        if self._group is not None and self._flattened is not policy:
            # One buffer laid out like the update file: each broadcast is a plain slice of it.
            self._group.flatten_weights(policy)
            self._flattened = policy
        return self._client.update_weights(
            policy.state_dict(), version=version, **self._options
        ).version

    def close(self) -> None:
        if self._group is not None:
            self._group.close()


def rollout(client: RolloutClient, config: TrainConfig, step: int, version: int) -> Experience:
    """One step of experience: prompts_per_step groups of samples_per_prompt rows."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(config.prompts_per_step)]
    kl_options = {"kl_coef": config.kl_coef, "kl_estimator": "k3", "kl_mode": "loss"}
    experience = client.make_experience(
        prompts,
        gt_answers=[config.answer] * len(prompts),
        samples_per_prompt=config.samples_per_prompt,
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        logprobs_use_temperature=True,  # the log-probs policy_log_probs computes
        seed=config.seed * 1_000_003 + step,
        preset="openrlhf",
        algorithm={"advantage_estimator": "group_norm", **kl_options},
        rewards={config.reward: 1.0},
        min_policy_version=version,
        return_texts=True,  # a sample answer goes into the log now and then
        timeout_s=config.timeout_s,
        device=config.device,
    )
    made_by = set(experience.policy_version.tolist())
    if made_by != {version}:
        raise RuntimeError(f"rollout made by versions {made_by}, expected only {version}")
    return experience


def optimise(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    experience: Experience,
    config: TrainConfig,
    generator: torch.Generator,
) -> tuple[float, float]:
    """ppo_epochs passes over the rollout in shuffled mini-batches; mean (loss, clip fraction)."""
    buffer = ExperienceBuffer()
    buffer.append(experience)
    losses, clips = [], []
    for _epoch in range(config.ppo_epochs):
        for batch in buffer.iter_batches(config.mini_batch_rows, generator=generator):
            log_probs = policy_log_probs(
                policy,
                batch.sequences,
                batch.attention_mask,
                batch.num_actions,
                config.temperature,
            )  # (b, A)
            parts = grpo_loss(
                log_probs,
                batch.action_log_probs,
                batch.advantages,
                batch.action_mask,
                clip_eps=config.clip_eps,
                base_log_probs=batch.base_action_log_probs,
                kl_coef=config.kl_coef,
            )
            optimizer.zero_grad(set_to_none=True)
            parts.loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            losses.append(parts.policy_loss)
            clips.append(parts.clip_fraction)
    return sum(losses) / len(losses), sum(clips) / len(clips)


def train(
    config: TrainConfig, client: RolloutClient, log: Callable[[str], None] = print
) -> list[StepStats]:
    """Run `config.steps` GRPO steps against the server behind `client`."""
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    policy = load_policy(config)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=config.lr, weight_decay=0.0)
    # Ready first: a spawned server is still loading, and a "dist" pusher joins it to a group.
    served_version = sync_server(client, policy)
    pusher = WeightPusher(client, config)
    try:
        return _train_steps(
            config, client, policy, optimizer, generator, pusher, served_version, log
        )
    finally:
        pusher.close()


def _train_steps(
    config: TrainConfig,
    client: RolloutClient,
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    pusher: WeightPusher,
    served_version: int,
    log: Callable[[str], None],
) -> list[StepStats]:
    # Push the initial policy so the server samples from exactly our weights (one full update
    # above whatever version a running server is at).
    version = pusher.push(policy, served_version + 1)
    history: list[StepStats] = []
    for step in range(config.steps):
        started_s = time.monotonic()
        experience = rollout(client, config, step, version)
        rolled_s = time.monotonic()
        loss, clip_fraction = optimise(policy, optimizer, experience, config, generator)
        trained_s = time.monotonic()
        version = pusher.push(policy, version + 1)
        stats = StepStats(
            step=step,
            policy_version=int(experience.policy_version[0]),
            reward_mean=float(experience.info[f"reward/{config.reward}"].float().mean()),
            kl=mean_kl(experience),
            response_length=float(experience.action_mask.sum(-1).float().mean()),
            policy_loss=loss,
            clip_fraction=clip_fraction,
            rollout_s=rolled_s - started_s,
            train_s=trained_s - rolled_s,
            update_s=time.monotonic() - trained_s,
        )
        history.append(stats)
        log(format_stats(stats))
        if step % 10 == 0 or step == config.steps - 1:
            texts = experience.response_texts or ()
            log(f"  sample answers: {list(texts[:4])!r}")
    return history


def format_stats(s: StepStats) -> str:
    seconds = s.rollout_s + s.train_s + s.update_s
    return (
        f"step {s.step:4d}  v{s.policy_version:<4d} reward {s.reward_mean:.3f}  kl {s.kl:.4f}  "
        f"len {s.response_length:5.1f}  loss {s.policy_loss:+.4f}  clip {s.clip_fraction:.3f}  "
        f"{seconds:5.2f} s (rollout {s.rollout_s:.2f}, train {s.train_s:.2f}, "
        f"update {s.update_s:.2f})"
    )


def write_curve(history: Sequence[StepStats], config: TrainConfig) -> list[Path]:
    """curve.csv, curve.json (with the config) and, with matplotlib, reward_curve.png."""
    out = config.out_dir
    rows = [asdict(s) for s in history]
    csv_path, json_path = out / "curve.csv", out / "curve.json"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[fd.name for fd in fields(StepStats)])
        writer.writeheader()
        writer.writerows(rows)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()}
    json_path.write_text(json.dumps({"config": settings, "steps": rows}, indent=1) + "\n")
    written = [csv_path, json_path]
    if config.plot and history:
        written.append(plot_curve(history, config, out / "reward_curve.png"))
    return written


def plot_curve(history: Sequence[StepStats], config: TrainConfig, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display needed (containers, CI)
    import matplotlib.pyplot as plt

    steps = [s.step for s in history]
    rewards = [s.reward_mean for s in history]
    window = 5
    smooth = [_mean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, rewards, color="tab:blue", alpha=0.35, label="mean reward per step")
    ax.plot(steps, smooth, color="tab:blue", label=f"moving average ({window} steps)")
    ax.set_xlabel("step (one rollout + weight update)")
    ax.set_ylabel(f"{config.reward} reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"GRPO through rollserve: answer {config.answer!r} (seed {config.seed})")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


_HELP = {
    "steps": "rollout + optimise + push rounds",
    "seed": "seeds sampling (per step), mini-batch shuffling and torch",
    "lr": "AdamW learning rate",
    "prompts_per_step": "prompts per rollout (GRPO groups)",
    "samples_per_prompt": "GRPO group size",
    "max_new_tokens": "response budget per row",
    "temperature": "sampling temperature (the log-probs use it too)",
    "ppo_epochs": "passes over each rollout",
    "mini_batch_rows": "rows per optimizer step",
    "clip_eps": "PPO ratio clip",
    "kl_coef": "weight of the k3 KL to the reference in the loss; 0 disables",
    "answer": "ground-truth answer of every prompt",
    "reward": "server reward source scored against the answer",
    "device": "where the trainer's policy lives (cpu, cuda)",
    "timeout_s": "deadline of each RPC",
    "transport": "how weights reach the server: auto, grpc, shm or dist",
    "streams": "parallel gRPC streams for grpc/auto (0: one per 4 cores)",
}
_POSITIVE = ("steps", "prompts_per_step", "samples_per_prompt", "ppo_epochs", "mini_batch_rows")


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    defaults = TrainConfig(out_dir=Path("runs/train_grpo"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--target", help="HOST:PORT of a running server (default: spawn one)")
    where.add_argument(
        "--spawn-server", action="store_true", help="start a local server (the default)"
    )
    parser.add_argument(
        "--out", type=Path, default=defaults.out_dir, help="output folder (default: %(default)s)"
    )
    parser.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG")
    parser.add_argument(
        "--actor", help="HF model dir of the policy and of a spawned server (default: built-in)"
    )
    for name, text in _HELP.items():
        default = getattr(defaults, name)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"{text} (default: %(default)s)",
        )
    ns = vars(parser.parse_args(argv))
    for name in _POSITIVE:
        if ns[name] < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not ns["temperature"] > 0:  # greedy rows have no sampling distribution to optimise
        parser.error("--temperature must be > 0")
    ns.pop("spawn_server")
    ns["out_dir"] = ns.pop("out")
    return TrainConfig(**ns)


def run(config: TrainConfig, log: Callable[[str], None] = print) -> list[StepStats]:
    """Train against `config.target`, or against a server spawned on the initial actor."""
    config.out_dir.mkdir(parents=True, exist_ok=True)
    if config.target is not None:
        with RolloutClient(config.target, timeout_s=config.timeout_s) as client:
            history = train(config, client, log)
    else:
        with LocalServer(_spawn_flags(config), config.out_dir) as server:
            log(f"spawned server at {server.target} (log: {server.log_path})")
            with RolloutClient(server.target, timeout_s=config.timeout_s) as client:
                history = train(config, client, log)
    for path in write_curve(history, config):
        log(f"wrote {path}")
    return history


def _spawn_flags(config: TrainConfig) -> list[str]:
    # The built-in actor is what load_policy builds too; with --actor both load the same dir.
    flags = ["--device", "cuda" if config.device.startswith("cuda") else "cpu"]
    if config.actor is not None:
        flags += ["--actor", config.actor]
    return flags


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    history = run(config)
    head = history[: max(1, len(history) // 5)]
    tail = history[-max(1, len(history) // 5) :]
    first = sum(s.reward_mean for s in head) / len(head)
    last = sum(s.reward_mean for s in tail) / len(tail)
    print(f"mean reward: first {len(head)} steps {first:.3f} -> last {len(tail)} steps {last:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
