"""The environment switches of the engine and scoring, read one way.

Three kinds: an on/off lever whose default is "on CUDA only" (`cuda_switch`: "0" or "1" forces
it), a choice among names (`env_choice`: a name outside them is a ValueError that says what the
variable may hold, never a silent default), and a count (`env_count`: an integer >= 0, else a
ValueError).
"""

from __future__ import annotations

import os
from collections.abc import Collection

import torch

__all__ = ["cuda_switch", "env_choice", "env_count"]


def cuda_switch(env: str, device: torch.device) -> bool:
    """Whether a lever is on for `device`: `env` "0" or "1" says so; unset (or anything else),
    on CUDA only."""
    forced = os.environ.get(env, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return device.type == "cuda"


def env_choice(env: str, names: Collection[str], default: str) -> str:
    """The name `env` holds (stripped; `default` when unset or empty); ValueError naming the
    variable and the names it may hold for any other."""
    name = os.environ.get(env, "").strip() or default
    if name not in names:
        raise ValueError(f"{env}={name!r}: expected one of {sorted(names)}")
    return name


def env_count(env: str, default: int) -> int:
    """The integer >= 0 `env` holds (`default` when unset or empty); ValueError naming the
    variable for anything else."""
    text = os.environ.get(env, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{env}={text!r}: expected an integer >= 0")
    return value
