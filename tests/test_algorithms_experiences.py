"""LightRFT's experiences through the experience maker: the request's micro-batches are the
experiences that experience_norm, the per-experience clip and the gamma quirk act on, even when
they straddle generation batches, and truncated rows reach the ProRL penalty.

The reference is shape_experience over the request's rows with experience_rows set to the
micro-batch size (tests/test_presets.py checks shape_experience itself against loops).
"""

from __future__ import annotations

import pytest
import torch
from rollserve.client.protocol.experience import concat_experiences
from rollserve.client.protocol.requests import build_make_experience_request
from rollserve.server.algorithms import resolve_algorithm, shape_experience
from rollserve.server.config import ServerConfig
from rollserve.server.experience.maker import NaiveExperienceMaker
from rollserve.server.experience.request import RequestDefaults
from rollserve.server.experience.rewards import RewardRegistry
from rollserve.server.models import load_models
from rollserve.v1 import rollout_pb2 as pb

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [40], [70, 71]]
MAX_NEW_TOKENS = 6


def length_reward(
    prompts: list[str], responses: list[str], gt_answers: list[str | None]
) -> list[float]:
    """A reward that varies between rows: the response length in characters."""
    return [float(len(r)) for r in responses]


@pytest.fixture(scope="module")
def maker(tiny_actor_dir) -> NaiveExperienceMaker:
    models = load_models(ServerConfig(actor=str(tiny_actor_dir), device="cpu"))
    defaults = RequestDefaults(
        default_preset="lightrft",
        max_new_tokens=MAX_NEW_TOKENS,
        generate_batch_size=64,
        forward_batch_size=16,
        micro_batch_size=16,
        max_request_rows=4096,
    )
    registry = RewardRegistry.from_specs(["length=tests.test_algorithms_experiences:length_reward"])
    return NaiveExperienceMaker(models, registry, defaults)


def test_experiences_are_the_micro_batches_of_the_request(maker: NaiveExperienceMaker) -> None:
    algorithm = {
        "advantage_estimator": "reinforce",
        "gamma": 0.5,
        "kl_coef": 0.0,
        "experience_norm": True,
        "advantage_clip": 0.5,
        "reproduce_upstream_quirks": True,
        "stop_properly_penalty": -1.0,
    }
    # 8 rows; generation batches of 2 rows, micro-batches (experiences) of 4 rows.
    request = build_make_experience_request(
        PROMPTS,
        samples_per_prompt=2,
        seed=3,
        preset="lightrft",
        algorithm=algorithm,
        rewards=["length"],
        max_new_tokens=MAX_NEW_TOKENS,
        generate_batch_size=2,
        micro_batch_size=4,
    )
    spec = maker.decode(request)
    assert spec.algorithm.shapes_whole_request
    batches = list(maker.iter_experience(spec, policy_version=0))
    assert [b.num_rows for b in batches] == [4, 4]
    e = concat_experiences(batches)
    cfg = resolve_algorithm(
        pb.AlgorithmOptions(preset="lightrft", **algorithm),
        default_preset="lightrft",
        has_critic=False,
    )
    kwargs = dict(
        action_log_probs=e.action_log_probs,
        base_action_log_probs=None,
        action_mask=e.action_mask,
        values=None,
        rewards=e.info["reward/length"],
        group_size=2,
        max_new_tokens=MAX_NEW_TOKENS,
        truncated=e.info["truncated"],
    )
    expected = shape_experience(cfg, experience_rows=4, **kwargs)
    valid = e.action_mask
    torch.testing.assert_close(e.advantages[valid], expected.advantages[valid].float())
    torch.testing.assert_close(e.returns[valid], expected.returns[valid].float())
    torch.testing.assert_close(e.reward, expected.reward.float())
    torch.testing.assert_close(
        e.info["advantage_clip_frac"], expected.info["advantage_clip_frac"].float()
    )
    # The ProRL penalty reached the truncated rows; the experiences matter.
    truncated = e.info["truncated"]
    assert truncated.any()
    assert torch.all(e.reward[truncated] == -1.0)
    one_experience = shape_experience(cfg, experience_rows=None, **kwargs)
    assert not torch.allclose(e.returns[valid], one_experience.returns[valid].float())
