"""The model roles a server hosts: each role's name and its wire ModelRole, written once.

The names are the server's (its --actor/--reference/--critic/--reward models, metric labels,
log lines) and the client's (`update_weights(target="critic")`); the wire carries ModelRole.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ...v1 import rollout_pb2 as pb
from .errors import InvalidArgument

__all__ = ["ROLES", "ROLE_NAMES", "WIRE_ROLES", "wire_role"]

_TABLE = (
    ("actor", pb.MODEL_ROLE_ACTOR),
    ("reference", pb.MODEL_ROLE_REFERENCE),
    ("critic", pb.MODEL_ROLE_CRITIC),
    ("reward", pb.MODEL_ROLE_REWARD),
)

# The role names, in the order a server loads and reports its models.
ROLES: tuple[str, ...] = tuple(name for name, _ in _TABLE)
# role name -> wire ModelRole.
WIRE_ROLES: Mapping[str, int] = MappingProxyType(dict(_TABLE))
# wire ModelRole -> role name; an update header's UNSPECIFIED target means the actor.
ROLE_NAMES: Mapping[int, str] = MappingProxyType(
    {pb.MODEL_ROLE_UNSPECIFIED: "actor", **{role: name for name, role in _TABLE}}
)


def wire_role(value: int | str, *, field: str = "target") -> int:
    """The wire ModelRole of a role name ("critic", any case) or of a ModelRole number."""
    if isinstance(value, str):
        role = WIRE_ROLES.get(value.lower())
        if role is None:
            raise InvalidArgument(f"{field}: unknown name {value!r} (one of {', '.join(ROLES)})")
        return role
    if isinstance(value, bool) or value not in pb.ModelRole.values():
        raise InvalidArgument(f"{field}: unknown value {value!r}")
    return int(value)
