"""jaxserve's HTTP face: an OpenAI-compatible FastAPI app over the engine's public API."""

from jaxserve.server.app import create_app

__all__ = ["create_app"]
