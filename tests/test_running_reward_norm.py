"""LightRFT's running reward normalisation (AlgorithmOptions.reward_running_norm).

The references are plain loops written here: the moments by Welford's one-sample-at-a-time
update from LightRFT's prior (count 1e-24, mean 0, var 1), which the server's batch
combination must equal; group normalisation, clip, token reward and returns as in
docs/reference/experience_math.md 3.4-3.5. They never call the functions under test. The last
tests go through real gRPC servers on 127.0.0.1:0: the moments leave with one request's
Experience and come back with the next request, on the same server or another replica.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import pytest
import torch
from helpers_server import serve_in_process
from rollserve.client.client import RolloutClient
from rollserve.client.protocol.errors import InvalidArgument
from rollserve.client.protocol.experience import Experience
from rollserve.client.protocol.requests import ExperienceOptions, build_make_experience_request
from rollserve.client.protocol.reward_moments import RunningRewardMoments
from rollserve.server.algorithms import resolve_algorithm, shape_experience
from rollserve.server.algorithms.running_norm import running_normalise
from rollserve.server.config import ServerConfig
from rollserve.server.experience.micro_batches import select_rows
from rollserve.server.models import ModelSet, load_models
from rollserve.server.serving.app import RolloutServer
from rollserve.v1 import rollout_pb2 as pb
from rollserve.v1 import rollout_pb2_grpc

F64 = torch.float64
KEYS = ("reward_moments/count", "reward_moments/mean", "reward_moments/var")


# ---- the reference, in plain loops -----------------------------------------------------------


class Welford:
    """Running count, mean and sum of squared deviations, one sample at a time; starts as
    LightRFT's RunningMoments() (a pseudo-history of weight 1e-24 with variance 1)."""

    def __init__(self, count: float = 0.0, mean: float = 0.0, var: float = 0.0) -> None:
        if count == 0:
            count, mean, var = 1e-24, 0.0, 1.0
        self.count, self.mean, self.m2 = count, mean, var * count

    def add(self, x: float) -> None:
        self.count += 1
        delta = x - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (x - self.mean)

    @property
    def var(self) -> float:  # population variance
        return self.m2 / self.count

    @property
    def std(self) -> float:  # LightRFT's: the unbiased correction, no epsilon
        if self.count - 1 == 0:
            return math.inf
        return math.sqrt(self.m2 / (self.count - 1))


def reference_running_norm(
    rewards: list[float], experience_rows: int, mode: str, state: Welford
) -> tuple[list[float], list[tuple[float, float, float]]]:
    """Per experience, in order: every reward in, then each normalised by the updated moments.
    Returns (normalised, per row (count, mean, var) after its experience)."""
    out: list[float] = []
    moments: list[tuple[float, float, float]] = []
    for start in range(0, len(rewards), experience_rows):
        block = rewards[start : start + experience_rows]
        for x in block:
            state.add(x)
        for x in block:
            centred = x - state.mean if mode == "standardize" else x
            out.append(centred / state.std)
            moments.append((state.count, state.mean, state.var))
    return out, moments


def group_norm(rewards: list[float], n: int) -> list[float]:
    out = []
    for g in range(0, len(rewards), n):
        xs = rewards[g : g + n]
        mean = sum(xs) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
        out += [(x - mean) / (std + 1e-9) for x in xs]
    return out


def clip(xs: list[float], c: float) -> list[float]:
    return [max(-c, min(c, x)) for x in xs]


def moments_of(info: dict[str, torch.Tensor]) -> list[tuple[float, float, float]]:
    return list(zip(*(info[key].tolist() for key in KEYS), strict=True))


def assert_moments(got: dict[str, torch.Tensor], expected: list, tol: float) -> None:
    assert all(got[key].dtype == F64 for key in KEYS)
    for g, e in zip(moments_of(got), expected, strict=True):
        assert g == pytest.approx(e, rel=tol, abs=tol)


# ---- the maths alone -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["scale", "standardize"])
@pytest.mark.parametrize("start", [None, (7.0, 0.3, 2.0)], ids=["fresh", "threaded"])
def test_batch_update_equals_one_sample_at_a_time(mode: str, start) -> None:
    gen = torch.Generator().manual_seed(3)
    rewards = (torch.randn(10, generator=gen, dtype=F64) * 2 + 1).tolist()
    moments = None if start is None else RunningRewardMoments(*start)
    out, info = running_normalise(torch.tensor(rewards, dtype=F64), moments, 4, mode)
    state = Welford(*(start or (0.0, 0.0, 0.0)))
    expected, expected_moments = reference_running_norm(rewards, 4, mode, state)  # 4 + 4 + 2
    torch.testing.assert_close(out, torch.tensor(expected, dtype=F64), rtol=1e-9, atol=1e-9)
    assert_moments(info, expected_moments, 1e-9)
    assert moments_of(info)[-1][0] == (start[0] if start else 0.0) + 10


def test_a_first_experience_of_one_row_is_zero_as_upstream() -> None:
    # count 1e-24 + 1 rounds to 1: std = sqrt(var * 1 / 0) is infinite, so R / std = 0. The
    # prior's M2 (1e-24) plus its correction (3^2 * 1e-24) stays behind as the variance.
    out, info = running_normalise(torch.tensor([3.0]), None, 1, "scale")
    assert out.tolist() == [0.0]
    assert moments_of(info) == [(1.0, 3.0, pytest.approx(1e-23))]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["scale", "standardize"])
def test_cuda_equals_cpu(mode: str) -> None:
    # Rewards on the device stay there: the moments are device tensors, no host round trip.
    rewards = torch.randn(10, generator=torch.Generator().manual_seed(5))
    start = RunningRewardMoments(count=5.0, mean=-0.5, var=3.0)
    cpu = running_normalise(rewards, start, 4, mode)
    cuda = running_normalise(rewards.cuda(), start, 4, mode)
    assert cuda[0].device.type == "cuda" and cuda[0].dtype == torch.float32
    torch.testing.assert_close(cuda[0].cpu(), cpu[0], rtol=1e-6, atol=1e-6)
    for key in KEYS:
        assert cuda[1][key].device.type == "cuda"
        torch.testing.assert_close(cuda[1][key].cpu(), cpu[1][key], rtol=1e-12, atol=1e-12)


# ---- through shape_experience, two requests ---------------------------------------------------

A = 5
N = 3  # samples per prompt


def _batch(rows: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = [(i * 2) % A + 1 for i in range(rows)]  # ragged: 1, 3, 5, 2, 4, ...
    mask = torch.tensor([[t < n for t in range(A)] for n in lengths])
    mask[1] = torch.tensor([True, False, True, False, False])  # a gap (multi-turn)
    return {
        "action_log_probs": -torch.rand(rows, A, generator=gen, dtype=F64) * 3,
        "base_action_log_probs": -torch.rand(rows, A, generator=gen, dtype=F64) * 3,
        "action_mask": mask,
        "values": None,
        "rewards": (torch.randn(rows, generator=gen, dtype=F64) * 4).round(decimals=2),
    }


def _expected_returns(batch: dict, shaped: list[float], beta: float, gamma: float) -> list:
    """LightRFT's token reward (k3 on the masked log-ratio, R at the last valid column) and
    cumulative returns, row by row."""
    out = []
    lp, ref = batch["action_log_probs"].tolist(), batch["base_action_log_probs"].tolist()
    for i, m in enumerate(batch["action_mask"].int().tolist()):
        last = max(t for t in range(A) if m[t])
        d = [(lp[i][t] - ref[i][t]) * m[t] for t in range(A)]
        r = [-beta * (math.exp(-x) - 1 + x) + (shaped[i] if t == last else 0.0) for x, t in
             zip(d, range(A), strict=True)]  # fmt: skip
        running, returns = 0.0, [0.0] * A
        for t in reversed(range(A)):
            running = r[t] * m[t] + gamma * running
            returns[t] = running
        out.append(returns)
    return out


# group_norm's experiences have mean 0, so only reinforce (its rewards as they are; without
# LightRFT's whitening, to read the advantages directly) tells the two modes apart.
ESTIMATORS = {"group_norm": lambda raw: group_norm(raw, N), "reinforce": lambda raw: raw}


@pytest.mark.parametrize("mode", ["scale", "standardize"])
@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_lightrft_threads_the_moments_over_two_requests(estimator: str, mode: str) -> None:
    beta, gamma, reward_clip, micro = 0.05, 0.5, 0.9, 6  # gamma and clip exact in float32
    options = pb.AlgorithmOptions(
        preset="lightrft",
        advantage_estimator=estimator,
        kl_coef=beta,
        gamma=gamma,
        reward_clip=reward_clip,
        reward_running_norm=mode,
        whitening="none",
    )
    cfg = resolve_algorithm(options, default_preset="openrlhf", has_critic=False)
    state = Welford()
    moments: RunningRewardMoments | None = None
    clipped = 0
    for rows, seed in ((12, 1), (9, 2)):  # experiences of 6 + 6, then 6 + 3 rows
        batch = _batch(rows, seed)
        out = shape_experience(
            cfg,
            group_size=N,
            max_new_tokens=A,
            experience_rows=micro,
            reward_moments=moments,
            **batch,
        )
        raw = batch["rewards"].tolist()
        normalised, expected_moments = reference_running_norm(
            ESTIMATORS[estimator](raw), micro, mode, state
        )
        shaped = clip(normalised, reward_clip)
        clipped += sum(abs(x) > reward_clip for x in normalised)
        expected = _expected_returns(batch, shaped, beta, gamma)
        tol = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.advantages, torch.tensor(expected, dtype=F64), **tol)
        torch.testing.assert_close(out.returns, torch.tensor(expected, dtype=F64), **tol)
        torch.testing.assert_close(out.reward, batch["rewards"])  # stored before any shaping
        assert_moments(out.info, expected_moments, 1e-5)
        moments = RunningRewardMoments.from_info(out.info)  # what the trainer sends next
    assert clipped > 0  # the clip acted on the normalised rewards
    assert moments.count == pytest.approx(21)


def test_cpgd_advantages_ignore_it_but_the_moments_still_advance() -> None:
    # LightRFT's CPGD reads the recipe reward, yet its experience loop updates the moments.
    batch = _batch(6, 4)
    base = pb.AlgorithmOptions(preset="lightrft", advantage_estimator="cpgd", kl_coef=0.0)
    with_norm = pb.AlgorithmOptions()
    with_norm.CopyFrom(base)
    with_norm.reward_running_norm = "standardize"
    outs = [
        shape_experience(
            resolve_algorithm(o, default_preset="openrlhf", has_critic=False),
            group_size=N,
            max_new_tokens=A,
            experience_rows=3,
            **batch,
        )
        for o in (base, with_norm)
    ]
    torch.testing.assert_close(outs[0].advantages, outs[1].advantages)
    assert KEYS[0] not in outs[0].info
    assert outs[1].info[KEYS[0]].tolist() == [3.0] * 3 + [6.0] * 3


def test_options_name_the_field() -> None:
    with pytest.raises(InvalidArgument, match="algorithm.reward_running_norm"):
        resolve_algorithm(
            pb.AlgorithmOptions(reward_running_norm="minus_mean"),
            default_preset="lightrft",
            has_critic=False,
        )
    for bad in (dict(count=-1.0, var=1.0), dict(count=2.0, var=-1.0), dict(mean=1.0)):
        with pytest.raises(InvalidArgument, match="reward_moments"):
            RunningRewardMoments(**bad)
    with pytest.raises(TypeError, match="reward_moments="):
        ExperienceOptions(algorithm={"reward_moments": RunningRewardMoments()})


# ---- through gRPC: the moments round-trip, on one server or across replicas ------------------

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [40], [70, 71]]
RUN = dict(
    samples_per_prompt=N,
    max_new_tokens=6,
    preset="lightrft",
    algorithm={
        "advantage_estimator": "reinforce",
        "whitening": "none",  # so the advantages show the shaped reward as it is
        "kl_coef": 0.0,
        "reward_clip": 1.0,
        "reward_running_norm": "standardize",
    },
    rewards=["reward_model"],
    micro_batch_size=6,  # two experiences per request
    generate_batch_size=3,  # four generation batches: the request is shaped whole
)


@pytest.fixture(scope="module")
def models(tiny_actor_dir, tiny_reward_dir) -> ModelSet:
    return load_models(
        ServerConfig(actor=str(tiny_actor_dir), reward_model=str(tiny_reward_dir), device="cpu")
    )


@pytest.fixture(scope="module")
def replicas(models: ModelSet) -> Iterator[tuple[RolloutServer, RolloutServer]]:
    servers = (serve_in_process(models), serve_in_process(models))
    yield servers
    for server in servers:
        server.stop(0)


def _check_request(micro_batches: list[Experience], state: Welford, reward_clip: float) -> None:
    """Each micro-batch against the loops: its moments and its advantages at column 0 (with
    kl_coef 0 and gamma 1, the row's clipped shaped reward)."""
    for e in micro_batches:
        assert e.num_rows == 6
        normalised, expected_moments = reference_running_norm(
            e.reward.tolist(), 6, "standardize", state
        )
        assert_moments(e.info, expected_moments, 1e-5)
        expected = torch.tensor(clip(normalised, reward_clip))
        torch.testing.assert_close(e.advantages[:, 0], expected, rtol=1e-5, atol=1e-5)


def test_moments_round_trip_through_grpc_and_any_replica(replicas) -> None:
    first, second = replicas
    with (
        RolloutClient(first.address, timeout_s=60) as a,
        RolloutClient(second.address, timeout_s=60) as b,
    ):
        state = Welford()
        streamed = list(a.stream_experience(PROMPTS, seed=1, **RUN))
        _check_request(streamed, state, 1.0)
        moments = RunningRewardMoments.from_experience(streamed[-1])
        assert moments.count == 12
        # The next request, threaded: on the same server, and on the other replica.
        here = a.make_experience(PROMPTS, seed=2, reward_moments=moments, **RUN)
        there = b.make_experience(PROMPTS, seed=2, reward_moments=moments, **RUN)
        for name in ("advantages", "returns", "reward", "sequences"):
            assert torch.equal(getattr(here, name), getattr(there, name)), name
        for key in KEYS:
            assert torch.equal(here.info[key], there.info[key])
        _check_request(
            [select_rows(here, slice(0, 6)), select_rows(here, slice(6, 12))], state, 1.0
        )
        assert RunningRewardMoments.from_experience(here).count == 24
        # Not threaded, the same request starts again from no history: other numbers.
        fresh = a.make_experience(PROMPTS, seed=2, **RUN)
        assert not torch.equal(fresh.info[KEYS[1]], here.info[KEYS[1]])


@pytest.mark.parametrize(
    ("moments", "norm"),
    [
        (dict(count=-1.0, var=1.0), "standardize"),
        (dict(count=3.0, mean=float("nan"), var=1.0), "standardize"),
        (dict(count=3.0, var=-0.5), "scale"),
        (dict(count=3.0, var=0.0), "scale"),
        (dict(count=float("inf"), var=1.0), "scale"),
        (dict(mean=2.0), "scale"),  # count 0 is "no history": nothing else may be set
        (dict(count=3.0, var=1.0), "off"),  # moments without the normalisation
    ],
)
def test_bad_moments_are_invalid_argument(replicas, moments: dict, norm: str) -> None:
    request = build_make_experience_request(
        PROMPTS[:1],
        **{**RUN, "algorithm": {**RUN["algorithm"], "reward_running_norm": norm}},
    )
    request.algorithm.reward_moments.CopyFrom(pb.RewardMoments(**moments))
    with grpc.insecure_channel(replicas[0].address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.MakeExperience(request, timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "algorithm.reward_moments" in caught.value.details()
