"""`python -m swarm ...` (and the `hivepipe` command): the library's command line."""

from swarm.cli.main import main

__all__ = ["main"]
