"""`python -m rollserve.server [serve|health] ...`; with no command it serves."""

from __future__ import annotations

import sys

from .serving.cli import main

if __name__ == "__main__":
    sys.exit(main(default_command="serve", prog="python -m rollserve.server"))
