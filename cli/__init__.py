"""The composition root: the `jaxserve` command wires the core (`jaxserve/`), the checkpoint formats and the HTTP
server together. Nothing below this layer imports it."""

from jaxserve.cli.main import main

__all__ = ["main"]
