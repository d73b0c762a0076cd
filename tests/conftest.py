"""Shared fixtures: tiny real transformers models saved to temp dirs (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_actor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random LlamaForCausalLM + byte tokenizer, saved with save_pretrained."""
    from rollserve.server.models.default_model import save_tiny_causal_lm

    return save_tiny_causal_lm(tmp_path_factory.mktemp("actor"))


@pytest.fixture(scope="session")
def tiny_critic_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollserve.server.models.default_model import save_tiny_scalar_head

    return save_tiny_scalar_head(tmp_path_factory.mktemp("critic"), "critic")


@pytest.fixture(scope="session")
def tiny_reward_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollserve.server.models.default_model import save_tiny_scalar_head

    return save_tiny_scalar_head(tmp_path_factory.mktemp("reward"), "reward")
