"""jaxserve Weights -> a checkpoint folder in DeepSeek's released naming: the inverse of `checkpoints.deepseek`.

Every name and layout comes from `weight_sources` (each Source splits a leaf back into its `[out, in]` tensors,
one per routed expert), so reading and writing share one table. With `quantize=True` the tensors the release
ships in low precision are written the same way: FP8 e4m3 with 128x128 ue8m0 block scales for the attention
and shared-expert projections, FP4 e2m1 (two per byte along the input dim, low nibble = even element) with 1x32
ue8m0 scales for the routed experts, each beside its `.scale` tensor.

Used to make the embedded default checkpoint and the tests' quantized checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxserve.checkpoints.deepseek import BF16, F32, FP4_PACKED, FP8, I64, scale_name, weight_sources
from jaxserve.config import ModelConfig, to_hf_dict
from jaxserve.kernels.quant import FP4, Quantized, dequantize
from jaxserve.kernels.quant import FP8 as FP8_E4M3
from jaxserve.kernels.quant import quantize as quantize_blocks
from jaxserve.model.weights import FP4_BLOCK, FP8_BLOCK, Weights, layer_arrays

INDEX = "model.safetensors.index.json"
_FLOAT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def quantize_tensor(w: np.ndarray, stored: str) -> tuple[np.ndarray, np.ndarray]:
    """[o, i] float -> (codes, ue8m0 scales) as the release stores them: FP8 e4m3 [o, i] with 128x128 block scales,
    or FP4 packed two per byte along i [o, i/2] (int8) with 1x32 scales; power-of-two scales, round to nearest even
    (the engine's own quantizer, on the transposed tensor for FP4, which packs along axis -2)."""
    w = np.asarray(w, np.float32)
    if stored == FP8:
        q = quantize_blocks(jnp.asarray(w), FP8_E4M3, (FP8_BLOCK, FP8_BLOCK))
        return np.asarray(q.codes), np.asarray(q.scales).view(ml_dtypes.float8_e8m0fnu)
    if w.ndim != 2 or w.shape[1] % 2:
        raise ValueError(f"FP4 packing needs a 2-D weight with an even input dim, got shape {list(w.shape)}")
    q = quantize_blocks(jnp.asarray(w.T), FP4, (FP4_BLOCK, 1))
    return np.asarray(q.codes).T.view(np.int8), np.asarray(q.scales).T.view(ml_dtypes.float8_e8m0fnu)


def checkpoint_tensors(
    weights: Weights, cfg: ModelConfig, quantize: bool = False, dtype: str = "bfloat16"
) -> dict[str, np.ndarray]:
    """Official name -> array as the release stores it.

    `dtype` is what the release's BF16 tensors become (and, without `quantize`, its FP8/FP4 ones): "bfloat16"
    or "float32". F32 tensors (HC params, sinks, ape, gate bias) stay float32; tid2eid is int64.
    """
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(_FLOAT_DTYPES)}")
    sources = weight_sources(cfg)
    out: dict[str, np.ndarray] = {}
    for leaf_name, leaf in layer_arrays(weights, cfg):
        source = sources[leaf_name]
        if isinstance(leaf, Quantized):  # re-quantizing its decoded values gives back the same codes and scales
            leaf = np.asarray(dequantize(leaf, jnp.float32))
        for name, tensor in zip(source.names, source.split(leaf)):
            if quantize and source.stored in (FP8, FP4_PACKED):
                try:
                    codes, scale = quantize_tensor(tensor, source.stored)
                except ValueError as bad:
                    raise ValueError(f"{name} ({leaf_name}): {bad}") from None
                out[name], out[scale_name(name)] = codes, scale
            elif source.stored == I64:
                out[name] = tensor.astype(np.int64)
            elif source.stored == F32:
                out[name] = tensor.astype(np.float32)
            else:
                assert source.stored in (BF16, FP8, FP4_PACKED), source.stored
                out[name] = tensor.astype(_FLOAT_DTYPES[dtype])
    return {name: np.ascontiguousarray(t) for name, t in out.items()}


def save_tensors(tensors: dict[str, np.ndarray], folder: str | Path, max_shard_bytes: int | None = None) -> list[Path]:
    """One `model.safetensors`, or `model-0000k-of-0000n.safetensors` shards of at most `max_shard_bytes` each
    (a larger tensor gets a shard to itself) plus `model.safetensors.index.json`. Returns the files written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if max_shard_bytes is not None and shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    if len(shards) == 1:
        files = [folder / "model.safetensors"]
    else:
        files = [folder / f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    for file, shard in zip(files, shards):
        save_file(shard, str(file), metadata={"format": "pt"})
        file.chmod(0o644)  # the library creates owner-only files; checkpoints are shared data
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": {name: file.name for file, shard in zip(files, shards) for name in sorted(shard)},
        }
        (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        files.append(folder / INDEX)
    return files


def write_config(cfg: ModelConfig, folder: str | Path) -> Path:
    file = Path(folder) / "config.json"
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(to_hf_dict(cfg), indent=2) + "\n")
    return file


def write_checkpoint(
    weights: Weights,
    cfg: ModelConfig,
    folder: str | Path,
    quantize: bool = False,
    dtype: str = "bfloat16",
    max_shard_bytes: int | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write `config.json` and the weights (see `checkpoint_tensors`, `save_tensors`) into `folder`; a quantized
    checkpoint's config says so as the release's does (quantization_config, expert_dtype). `extra_tensors`: stored
    beside the weights, as a release stores what `cfg` does not hold (a drafter)."""
    folder = Path(folder)
    tensors = checkpoint_tensors(weights, cfg, quantize=quantize, dtype=dtype) | (extra_tensors or {})
    save_tensors(tensors, folder, max_shard_bytes)
    formats = (FP8_E4M3, FP4) if quantize else (None, None)
    write_config(dataclasses.replace(cfg, linear_format=formats[0], expert_format=formats[1]), folder)
    return folder
