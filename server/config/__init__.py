"""Server settings: the ground floor every other server package imports."""

from .settings import (
    DTYPES,
    ENV_PREFIX,
    LOG_LEVELS,
    ConfigError,
    ServerConfig,
    build_parser,
    env_name,
    flag_name,
)

__all__ = [
    "ConfigError",
    "ServerConfig",
    "ENV_PREFIX",
    "DTYPES",
    "LOG_LEVELS",
    "build_parser",
    "env_name",
    "flag_name",
]
