"""Server settings: the ground floor every other server package imports.

`settings.py` holds ServerConfig and its parser, `flags.py` one row per flag, `values.py` the
parsers of single values; this face names what the rest of the server uses.
"""

from .settings import ConfigError, ServerConfig, build_parser, env_name, flag_name

__all__ = ["ConfigError", "ServerConfig", "build_parser", "env_name", "flag_name"]
