"""Checkpoint reading and writing (DeepSeek-V4 safetensors folders) and the embedded default checkpoint."""

from __future__ import annotations

from pathlib import Path


def default_checkpoint_path() -> Path:
    """The small DeepSeek-V4 checkpoint shipped with jaxserve (config, weights, tokenizer); see make_default.py."""
    return Path(__file__).resolve().parent / "default"
