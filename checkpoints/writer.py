"""jaxserve Weights -> a checkpoint folder in DeepSeek's released naming: the inverse of `checkpoints.deepseek`.

Every name and layout comes from `weight_sources` (each Source splits a leaf back into its `[out, in]` tensors,
one per routed expert), so reading and writing share one table. With `quantize=True` the tensors the release
ships in low precision are written the same way: FP8 e4m3 with 128x128 ue8m0 block scales for the attention
and shared-expert projections, FP4 e2m1 (two per byte along the input dim, low nibble = even element) with 1x32
ue8m0 scales for the routed experts, each beside its `.scale` tensor.

Used to make the embedded default checkpoint and the tests' quantized checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxserve.checkpoints.deepseek import BF16, F32, FP4, FP4_BLOCK, FP8, FP8_BLOCK, I64, scale_name, weight_sources
from jaxserve.config import ModelConfig, to_hf_dict
from jaxserve.model.weights import Weights, layer_arrays

FP8_MAX = 448.0  # largest finite e4m3fn
FP4_MAX = 6.0  # largest e2m1
INDEX = "model.safetensors.index.json"
_FLOAT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


def _pow2_at_least(x: np.ndarray) -> np.ndarray:
    """The exponent e of the smallest power of two 2^e >= x (x > 0), exactly (no log2 rounding)."""
    mantissa, exponent = np.frexp(x)  # x = m * 2^e, m in [0.5, 1)
    return np.where(mantissa == 0.5, exponent - 1, exponent).astype(np.int32)


def _e8m0(exponent: np.ndarray) -> np.ndarray:
    """Exponents -> ue8m0 scale bytes (2^(u - 127))."""
    return (np.clip(exponent, -127, 127) + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def _block_amax(w: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """max |w| over [rows x cols] blocks, a partial block at the end of either dim included."""
    o, i = w.shape
    bo, bi = -(-o // rows), -(-i // cols)
    padded = np.zeros((bo * rows, bi * cols), np.float32)
    padded[:o, :i] = np.abs(w)
    return padded.reshape(bo, rows, bi, cols).max(axis=(1, 3))


def _expand(scale: np.ndarray, rows: int, cols: int, shape: tuple[int, int]) -> np.ndarray:
    return np.repeat(np.repeat(scale, rows, axis=0), cols, axis=1)[: shape[0], : shape[1]]


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[o, i] float -> (e4m3 codes [o, i], ue8m0 scales [ceil(o/128), ceil(i/128)]), power-of-two block scales."""
    w = np.asarray(w, np.float32)
    exponent = _pow2_at_least(np.maximum(_block_amax(w, FP8_BLOCK, FP8_BLOCK), 1e-4) / FP8_MAX)
    scale = np.ldexp(np.float32(1), exponent)
    codes = (w / _expand(scale, FP8_BLOCK, FP8_BLOCK, w.shape)).astype(ml_dtypes.float8_e4m3fn)
    return codes, _e8m0(exponent)


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[o, i] float (i even) -> (packed int8 [o, i/2], ue8m0 scales [o, ceil(i/32)]), rounding to nearest even."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % 2:
        raise ValueError(f"FP4 packing needs a 2-D weight with an even input dim, got shape {list(w.shape)}")
    exponent = _pow2_at_least(np.maximum(_block_amax(w, 1, FP4_BLOCK), 1e-12) / FP4_MAX)
    scale = np.ldexp(np.float32(1), exponent)
    codes = (w / _expand(scale, 1, FP4_BLOCK, w.shape)).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # low nibble = element 2k, high nibble = element 2k+1
    return packed.view(np.int8), _e8m0(exponent)


def checkpoint_tensors(weights: Weights, cfg: ModelConfig, quantize: bool = False,
                       dtype: str = "bfloat16") -> dict[str, np.ndarray]:
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
        for name, tensor in zip(source.names, source.split(leaf)):
            if quantize and source.stored in (FP8, FP4):
                try:
                    codes, scale = (quantize_fp8 if source.stored == FP8 else quantize_fp4)(tensor)
                except ValueError as bad:
                    raise ValueError(f"{name} ({leaf_name}): {bad}") from None
                out[name], out[scale_name(name)] = codes, scale
            elif source.stored == I64:
                out[name] = tensor.astype(np.int64)
            elif source.stored == F32:
                out[name] = tensor.astype(np.float32)
            else:
                assert source.stored in (BF16, FP8, FP4), source.stored
                out[name] = tensor.astype(_FLOAT_DTYPES[dtype])
    return {name: np.ascontiguousarray(t) for name, t in out.items()}


def save_tensors(tensors: dict[str, np.ndarray], folder: str | Path,
                 max_shard_bytes: int | None = None) -> list[Path]:
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


def write_checkpoint(weights: Weights, cfg: ModelConfig, folder: str | Path, quantize: bool = False,
                     dtype: str = "bfloat16", max_shard_bytes: int | None = None) -> Path:
    """Write `config.json` and the weights (see `checkpoint_tensors`, `save_tensors`) into `folder`."""
    folder = Path(folder)
    save_tensors(checkpoint_tensors(weights, cfg, quantize=quantize, dtype=dtype), folder, max_shard_bytes)
    write_config(cfg, folder)
    return folder
