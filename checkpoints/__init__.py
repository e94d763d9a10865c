"""Checkpoint reading and writing (DeepSeek-V4 safetensors folders) and the embedded default checkpoint."""

from __future__ import annotations

from pathlib import Path


def default_checkpoint_path() -> Path:
    """The small DeepSeek-V4 checkpoint shipped with jaxserve (config, weights, tokenizer, model card), trained by
    `python -m training.train_default`."""
    return Path(__file__).resolve().parent / "default"
