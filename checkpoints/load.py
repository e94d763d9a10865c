"""One entry point from a model path (or none: the embedded default) to config, weights on the mesh, tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from jax.sharding import Mesh

from jaxserve.checkpoints import default_checkpoint_path
from jaxserve.checkpoints.deepseek import drafting_config, load_weights
from jaxserve.checkpoints.orbax_io import is_orbax_checkpoint, restore_weights
from jaxserve.config import ModelConfig
from jaxserve.model.sharding import for_mesh, shardings_for
from jaxserve.model.weights import Weights, abstract_weights
from jaxserve.text.tokenizer import TokenIdOnly, Tokenizer, load_tokenizer


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer | TokenIdOnly


def model_config(
    path: str | Path | None, dtype: str = "bfloat16", quantization: str = "auto", drafter: str | None = None
) -> ModelConfig:
    """The config a checkpoint (None: the embedded default) is served with: its config.json in `dtype`, its weights
    kept as it ships them (`quantization="auto"`) or dequantized (`"none"`), holding the drafter speculative
    decoding's `drafter` method drafts with ("mtp", "dspark"; None: none)."""
    folder = Path(path) if path is not None else default_checkpoint_path()
    return drafting_config(folder, drafter).with_dtype(dtype).with_quantization(quantization)


def load_model(
    path: str | Path | None,
    mesh: Mesh,
    dtype: str = "bfloat16",
    show_progress: bool = False,
    skip_tokenizer: bool = False,
    quantization: str = "auto",
    drafter: str | None = None,
) -> LoadedModel:
    """Load a DeepSeek-V4 checkpoint onto `mesh`: an orbax conversion (see `checkpoints.orbax_io`, which must have
    been converted in `dtype` and with the same quantization) is restored shard by shard, a safetensors folder
    streamed leaf by leaf into its target sharding. The config is the checkpoint's with its vocabulary padded to
    split over `mesh` (`sharding.for_mesh`): the weights hold the padded rows, `vocab_size` stays the real one."""
    folder = Path(path) if path is not None else default_checkpoint_path()
    config = for_mesh(model_config(folder, dtype, quantization, drafter), mesh)
    if is_orbax_checkpoint(folder):
        weights = restore_weights(folder, config, mesh, show_progress)
    else:
        weights, _ = load_weights(folder, config, shardings_for(abstract_weights(config), mesh), show_progress)
    return LoadedModel(folder, config, weights, load_tokenizer(folder, skip_tokenizer=skip_tokenizer))
