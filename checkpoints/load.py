"""One entry point from a model path (or none: the embedded default) to config, weights on the mesh, tokenizer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.checkpoints.deepseek import drafting_config, load_weights
from jaxserve.checkpoints.orbax_io import is_orbax_checkpoint, restore_weights
from jaxserve.config import ConfigError, ModelConfig
from jaxserve.model.engram import engram_layout, product_table
from jaxserve.model.sharding import for_mesh, shardings_for
from jaxserve.model.weights import Weights, abstract_weights
from jaxserve.text.ngram_vocab import compressed_token_map
from jaxserve.text.tokenizer import TokenIdOnly, Tokenizer, load_tokenizer


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer | TokenIdOnly


def model_config(
    path: str | Path | None,
    dtype: str = "bfloat16",
    quantization: str = "auto",
    drafter: str | None = None,
    engram_placement: str = "device",
) -> ModelConfig:
    """The config a checkpoint (None: the embedded default) is served with: its config.json in `dtype`, its weights
    kept as it ships them (`quantization="auto"`) or dequantized (`"none"`), holding the drafter speculative
    decoding's `drafter` method drafts with ("mtp", "dspark"; None: none), its Engram tables (if any) where
    `engram_placement` says."""
    folder = Path(path) if path is not None else default_checkpoint_path()
    config = drafting_config(folder, drafter).with_dtype(dtype).with_quantization(quantization)
    return config.with_engram_placement(engram_placement)


def load_model(
    path: str | Path | None,
    mesh: Mesh,
    dtype: str = "bfloat16",
    show_progress: bool = False,
    skip_tokenizer: bool = False,
    quantization: str = "auto",
    drafter: str | None = None,
    engram_placement: str = "device",
) -> LoadedModel:
    """Load a DeepSeek-V4 checkpoint onto `mesh`: an orbax conversion (see `checkpoints.orbax_io`, which must have
    been converted in `dtype` and with the same quantization) is restored shard by shard, a safetensors folder
    streamed leaf by leaf into its target sharding. The config is the checkpoint's with its vocabulary padded to
    split over `mesh` (`sharding.for_mesh`): the weights hold the padded rows, `vocab_size` stays the real one."""
    folder = Path(path) if path is not None else default_checkpoint_path()
    config = for_mesh(model_config(folder, dtype, quantization, drafter, engram_placement), mesh)
    shardings = shardings_for(abstract_weights(config), mesh)
    if is_orbax_checkpoint(folder):
        weights = restore_weights(folder, config, mesh, show_progress)
    else:
        weights, _ = load_weights(folder, config, shardings, show_progress)
    tokenizer = load_tokenizer(folder, skip_tokenizer=skip_tokenizer)
    if config.engram is not None:
        products = ngram_products(config, tokenizer, folder)
        weights = dataclasses.replace(weights, ngram_products=jax.device_put(products, shardings.ngram_products))
    return LoadedModel(folder, config, weights, tokenizer)


def ngram_products(config: ModelConfig, tokenizer: Tokenizer | TokenIdOnly, folder: Path) -> np.ndarray:
    """DeepSeek-V4.1's Engram hash products of every token id (jaxserve.model.engram.product_table), from the
    checkpoint's tokenizer: the n-grams are hashed over its compressed vocabulary, so the tokenizer is required and
    must give the compressed vocabulary the config was trained with."""
    engram = config.engram
    assert engram is not None
    if isinstance(tokenizer, TokenIdOnly):
        raise ConfigError(
            f"{folder}: DeepSeek-V4.1's Engram hashes n-grams over the tokenizer's compressed vocabulary, so the "
            "checkpoint's tokenizer.json is required (it cannot be skipped)"
        )
    token_map, size = compressed_token_map(tokenizer)
    if size != engram.compressed_vocab_size:
        raise ConfigError(
            f"{folder}: engram_compressed_vocab_size={engram.compressed_vocab_size}, but the tokenizer's compressed "
            f"vocabulary has {size} ids: the Engram tables were trained on another tokenizer"
        )
    pad = int(token_map[engram.pad_id])
    # Ids the model has and the tokenizer does not (a vocabulary padded for the split) hash as the pad token.
    ids = np.full(config.vocab_size, pad, np.int32)
    ids[: min(len(token_map), config.vocab_size)] = token_map[: config.vocab_size]
    return product_table(engram_layout(engram), ids, pad)
