"""DeepSeek-V4 checkpoint folders -> jaxserve Weights.

Accepts DeepSeek's released naming (`embed.weight`, `layers.N.attn.wq_a.weight`, `hc_head_fn`, ...) and what
transformers' `save_pretrained` writes for this model (the same names behind a `model.` prefix, except
`head.weight`, with `model.hc_head.hc_fn` for `hc_head_fn`). FP8 e4m3 weights with 128x128 ue8m0 block
scales and FP4 e2m1 packed experts with 1x32 scales are kept so (codes and scales, laid out like the leaf) where
the config keeps them quantized, and dequantized into the engine's dtype where it does not.

`weight_sources` is the one name table: each Source builds a leaf from its checkpoint tensors and splits it back
(`checkpoints.writer` writes folders with it). Every error names the file and the tensor.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from jaxserve.checkpoints.safetensors_file import CheckpointError, SafetensorsFolder
from jaxserve.config import ModelConfig, load_config
from jaxserve.kernels.quant import FP4, Quantized
from jaxserve.kernels.quant import FP8 as FP8_E4M3
from jaxserve.model.stacking import WeightsBuilder
from jaxserve.model.weights import ENGRAM_TABLE_BLOCKS, FP4_BLOCK, FP8_BLOCK, ArrayInfo, Weights, release_leaves
from jaxserve.progress import progress

log = logging.getLogger("jaxserve.checkpoints")
# The drafter's tensors (after transformers' `model.`): V4's MTP blocks, or 0731/0813's DSpark stages (also `mtp.*`)
# with their Markov and confidence heads.
DRAFTER_PREFIXES = ("mtp.", "markov_head.", "confidence_head.")
# A DSpark drafter kept beside a checkpoint instead of in it (the embedded default's, whose `mtp.0` is an MTP block):
# a folder of this name inside it, with its own config.json (the `dspark_*` keys) and the drafter's tensors.
DSPARK_FOLDER = "dspark"


def drafter_folder(folder: Path) -> Path | None:
    """The DSpark drafter kept beside the checkpoint in `folder` (DSPARK_FOLDER), if there is one."""
    apart = folder / DSPARK_FOLDER
    return apart if (apart / "config.json").is_file() else None


def with_drafter_apart(cfg: ModelConfig, folder: Path) -> ModelConfig:
    """`cfg` (the checkpoint's in `folder`) with the DSpark drafter kept beside it, where its own config has none."""
    apart = drafter_folder(folder)
    if cfg.dspark is not None or apart is None:
        return cfg
    return replace(cfg, dspark=load_config(apart).dspark)


def drafting_config(folder: Path, drafter: str | None) -> ModelConfig:
    """The config of the checkpoint in `folder` holding the drafter speculative decoding's `drafter` method drafts
    with ("mtp", "dspark", a DSpark drafter kept beside the checkpoint included; None: none)."""
    cfg = load_config(folder)
    return (with_drafter_apart(cfg, folder) if drafter == "dspark" else cfg).with_drafter(drafter)


FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


# How the release stores each tensor. Only the writer uses it: the loader accepts any float
# dtype, and treats a weight as quantized when a `.scale` tensor sits beside it.
FP8, FP4_PACKED, BF16, F32, I64 = "fp8", "fp4", "bf16", "f32", "i64"


@dataclass(frozen=True)
class Layout:
    """How checkpoint tensors (`[out, in]`, one per routed expert) become one Weights leaf, and back."""

    build: Callable[[list[np.ndarray]], np.ndarray]  # checkpoint tensors -> leaf
    split: Callable[[np.ndarray], list[np.ndarray]]  # leaf -> checkpoint tensors, in `Source.names` order
    # Whether `build` reshapes (splits or merges dims): then a tensor's grid of block scales is not laid out like
    # the leaf's, and scales are laid out element by element (see `_leaf_scales`).
    reshapes: bool = False


AS_IS = Layout(lambda ts: ts[0], lambda x: [x])
TRANSPOSED = Layout(lambda ts: ts[0].T, lambda x: [x.T])
EXPERTS_TRANSPOSED = Layout(lambda ts: np.stack([t.T for t in ts]), lambda x: [e.T for e in x])


def _heads_last(n_heads: int, head_dim: int) -> Layout:
    # [heads*dim, in] <-> [in, heads, dim]
    return Layout(
        lambda ts: ts[0].T.reshape(-1, n_heads, head_dim), lambda x: [x.reshape(x.shape[0], -1).T], reshapes=True
    )


def _grouped_out(cfg: ModelConfig) -> Layout:
    g, j, k = cfg.o_groups, cfg.heads_per_group, cfg.head_dim

    def build(ts):  # [g*o, j*k] -> [g, o, j, k] -> [g, j, k, o] -> [h, k, o]
        return ts[0].reshape(g, -1, j, k).transpose(0, 2, 3, 1).reshape(g * j, k, -1)

    def split(x):  # [h, k, o] -> [g, j, k, o] -> [g, o, j, k] -> [g*o, j*k]
        return [x.reshape(g, j, k, -1).transpose(0, 3, 1, 2).reshape(-1, j * k)]

    return Layout(build, split, reshapes=True)


@dataclass(frozen=True)
class Source:
    """How one leaf of Weights is built from checkpoint tensors (official names), and how the release stores them."""

    names: tuple[str, ...]
    layout: Layout
    stored: str = BF16  # FP8 | FP4_PACKED | BF16 | F32 | I64
    # An FP8 tensor's blocks (rows, columns) where they are not the model's square ones (ModelConfig.fp8_block):
    # V4.1's Engram tables, one scale per 32 channels of a row.
    fp8_blocks: tuple[int, int] | None = None

    def build(self, arrays: list[np.ndarray]) -> np.ndarray:
        return self.layout.build(arrays)

    def split(self, leaf: np.ndarray) -> list[np.ndarray]:
        return self.layout.split(leaf)

    def shapes(self, leaf_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The (dequantized) checkpoint tensor shapes a leaf of `leaf_shape` needs, without allocating it."""
        return [t.shape for t in self.split(np.broadcast_to(np.zeros((), np.float32), leaf_shape))]


def scale_name(weight_name: str) -> str:
    """`x.weight` -> `x.scale`: where the release keeps a quantized weight's block scales."""
    return weight_name[: -len("weight")] + "scale"


def _layer_sources(layer: str, cfg: ModelConfig) -> dict[str, Source]:
    """The Sources of one decoder layer's leaves (`layers.N`, or an MTP block's `mtp.N`, which names its layer's
    leaves alike)."""
    src: dict[str, Source] = {}
    experts = range(cfg.n_routed_experts)
    for sub in ("attn", "ffn"):
        src[f"{layer}.{sub}_hc.fn"] = Source((f"{layer}.hc_{sub}_fn",), TRANSPOSED, F32)
        src[f"{layer}.{sub}_hc.base"] = Source((f"{layer}.hc_{sub}_base",), AS_IS, F32)
        src[f"{layer}.{sub}_hc.scale"] = Source((f"{layer}.hc_{sub}_scale",), AS_IS, F32)
        src[f"{layer}.{sub}_norm"] = Source((f"{layer}.{sub}_norm.weight",), AS_IS)
    a = f"{layer}.attn"
    src.update(
        {
            f"{a}.wq_a": Source((f"{a}.wq_a.weight",), TRANSPOSED, FP8),
            f"{a}.q_norm": Source((f"{a}.q_norm.weight",), AS_IS),
            f"{a}.wq_b": Source((f"{a}.wq_b.weight",), _heads_last(cfg.num_heads, cfg.head_dim), FP8),
            f"{a}.wkv": Source((f"{a}.wkv.weight",), TRANSPOSED, FP8),
            f"{a}.kv_norm": Source((f"{a}.kv_norm.weight",), AS_IS),
            f"{a}.wo_a": Source((f"{a}.wo_a.weight",), _grouped_out(cfg), FP8),
            f"{a}.wo_b": Source((f"{a}.wo_b.weight",), TRANSPOSED, FP8),
            f"{a}.sinks": Source((f"{a}.attn_sink",), AS_IS, F32),
        }
    )
    for comp in (f"{a}.compressor", f"{a}.indexer.compressor"):
        src[f"{comp}.wkv"] = Source((f"{comp}.wkv.weight",), TRANSPOSED)
        src[f"{comp}.wgate"] = Source((f"{comp}.wgate.weight",), TRANSPOSED)
        src[f"{comp}.ape"] = Source((f"{comp}.ape",), AS_IS, F32)
        src[f"{comp}.norm"] = Source((f"{comp}.norm.weight",), AS_IS)
    src[f"{a}.indexer.wq_b"] = Source(
        (f"{a}.indexer.wq_b.weight",), _heads_last(cfg.index_n_heads, cfg.index_head_dim), FP8
    )
    src[f"{a}.indexer.weights_proj"] = Source((f"{a}.indexer.weights_proj.weight",), TRANSPOSED)
    src[f"{a}.indexer.wk"] = Source((f"{a}.indexer.wk.weight",), TRANSPOSED)
    src[f"{a}.indexer.k_norm"] = Source((f"{a}.indexer.k_norm.weight",), AS_IS)
    e = f"{layer}.engram"
    src[f"{e}.table"] = Source((f"{e}.embed.weight",), AS_IS, FP8, fp8_blocks=ENGRAM_TABLE_BLOCKS)
    src[f"{e}.wkv"] = Source((f"{e}.wkv.weight",), TRANSPOSED, FP8)
    src[f"{e}.q_weight"] = Source((f"{e}.q_weight",), AS_IS)
    src[f"{e}.k_weight"] = Source((f"{e}.k_weight",), AS_IS)
    m, mt = f"{layer}.moe", f"{layer}.ffn"
    src.update(
        {
            f"{m}.router": Source((f"{mt}.gate.weight",), TRANSPOSED),
            f"{m}.score_bias": Source((f"{mt}.gate.bias",), AS_IS, F32),
            f"{m}.tid2eid": Source((f"{mt}.gate.tid2eid",), AS_IS, I64),
            f"{m}.w_gate": Source(
                tuple(f"{mt}.experts.{e}.w1.weight" for e in experts), EXPERTS_TRANSPOSED, FP4_PACKED
            ),
            f"{m}.w_up": Source(tuple(f"{mt}.experts.{e}.w3.weight" for e in experts), EXPERTS_TRANSPOSED, FP4_PACKED),
            f"{m}.w_down": Source(
                tuple(f"{mt}.experts.{e}.w2.weight" for e in experts), EXPERTS_TRANSPOSED, FP4_PACKED
            ),
            f"{m}.shared_gate": Source((f"{mt}.shared_experts.w1.weight",), TRANSPOSED, FP8),
            f"{m}.shared_up": Source((f"{mt}.shared_experts.w3.weight",), TRANSPOSED, FP8),
            f"{m}.shared_down": Source((f"{mt}.shared_experts.w2.weight",), TRANSPOSED, FP8),
        }
    )
    return src


def _head_sources(prefix: str) -> dict[str, Source]:
    """The HC head and final norm: the model's (`prefix` '') or an MTP block's (`mtp.N.`)."""
    return {
        f"{prefix}norm": Source((f"{prefix}norm.weight",), AS_IS),
        f"{prefix}hc_head_fn": Source((f"{prefix}hc_head_fn",), TRANSPOSED, F32),
        f"{prefix}hc_head_base": Source((f"{prefix}hc_head_base",), AS_IS, F32),
        f"{prefix}hc_head_scale": Source((f"{prefix}hc_head_scale",), AS_IS, F32),
    }


def weight_sources(cfg: ModelConfig) -> dict[str, Source]:
    """Release name of a leaf (`release_leaves`: 'layers.3.attn.wq_b', 'embed', 'mtp.0.e_proj') -> its Source."""
    src: dict[str, Source] = {
        "embed": Source(("embed.weight",), AS_IS),
        "head": Source(("head.weight",), TRANSPOSED),
        **_head_sources(""),
    }
    for i in range(cfg.num_layers):
        src.update(_layer_sources(f"layers.{i}", cfg))
    for i in range(cfg.mtp_layers):
        block = f"mtp.{i}"
        src.update(_layer_sources(block, cfg))
        src.update(_head_sources(f"{block}."))
        for name in ("e_proj", "h_proj"):
            src[f"{block}.{name}"] = Source((f"{block}.{name}.weight",), TRANSPOSED, FP8)
        for name in ("enorm", "hnorm"):
            src[f"{block}.{name}"] = Source((f"{block}.{name}.weight",), AS_IS)
    if cfg.dspark_drafting and cfg.dspark is not None:
        stages = cfg.dspark.stages
        for i in range(stages):
            src.update(_layer_sources(f"mtp.{i}", cfg))
        last = f"mtp.{stages - 1}"
        src.update(_head_sources(f"{last}."))
        src["mtp.0.main_proj"] = Source(("mtp.0.main_proj.weight",), TRANSPOSED)  # dequantized if stored FP8
        src["mtp.0.main_norm"] = Source(("mtp.0.main_norm.weight",), AS_IS)
        src[f"{last}.markov_head.markov_w1"] = Source((f"{last}.markov_head.markov_w1.weight",), AS_IS)
        src[f"{last}.markov_head.markov_w2"] = Source((f"{last}.markov_head.markov_w2.weight",), TRANSPOSED)
    return src


# ---- reading and dequantizing -------------------------------------------------------------------------------------


def _e8m0(scale: np.ndarray) -> np.ndarray:
    if scale.dtype != ml_dtypes.float8_e8m0fnu:
        scale = scale.view(np.uint8).view(ml_dtypes.float8_e8m0fnu) if scale.dtype.itemsize == 1 else scale
    return scale.astype(np.float32)


def dequantize_fp8(
    weight: np.ndarray, scale: np.ndarray, blocks: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
) -> np.ndarray:
    """FP8 e4m3 [o, i] with block scales [ceil(o/rows), ceil(i/columns)] (`blocks`: V4's 128x128) -> float32."""
    s = np.repeat(np.repeat(_e8m0(scale), blocks[0], axis=0), blocks[1], axis=1)
    return weight.astype(np.float32) * s[: weight.shape[0], : weight.shape[1]]


def dequantize_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """FP4 e2m1 packed two per byte along the input dim (low nibble first) [o, i/2], 1x32 scales [o, i/32]."""
    u = packed.view(np.uint8)
    values = np.stack([FP4_VALUES[u & 0xF], FP4_VALUES[u >> 4]], axis=-1).reshape(u.shape[0], -1)
    return values * np.repeat(_e8m0(scale), FP4_BLOCK, axis=1)[:, : values.shape[1]]


class TensorReader:
    """Official-name access to a checkpoint folder in either naming scheme, dequantizing on read."""

    # Where transformers' save_pretrained puts an official name (behind its `model.` prefix) when it differs.
    HF_RENAMES = (
        (re.compile(r"^embed\.weight$"), "embed_tokens.weight"),
        (re.compile(r"^((?:mtp\.\d+\.)?)hc_head_(fn|base|scale)$"), r"\1hc_head.hc_\2"),
        (re.compile(r"^((?:layers|mtp)\.\d+\.attn)\.kv_norm\.weight$"), r"\1.norm.weight"),
    )

    # Where some conversions put a DSpark drafter's heads: at the top level, not under its last stage.
    ALTERNATES = ((re.compile(r"^mtp\.\d+\.(markov_head\.markov_w[12]\.weight)$"), r"\1"),)

    def __init__(self, folder: SafetensorsFolder, fp8_block: int = FP8_BLOCK):
        self.folder = folder
        self.prefixed = any(k.startswith("model.") for k in folder.keys())
        self.fp8_block = fp8_block  # the model's square FP8 blocks (ModelConfig.fp8_block)

    def stored_name(self, name: str) -> str:
        stored = self._official_or_hf(name)
        if stored not in self.folder:
            for pattern, replacement in self.ALTERNATES:
                alternate = self._official_or_hf(pattern.sub(replacement, name))
                if alternate in self.folder:
                    return alternate
        return stored

    def _official_or_hf(self, name: str) -> str:
        if not self.prefixed or name == "head.weight":
            return name
        for pattern, replacement in self.HF_RENAMES:
            renamed = pattern.sub(replacement, name)
            if renamed != name and "model." + renamed in self.folder:
                return "model." + renamed
        return "model." + name

    def __contains__(self, name: str) -> bool:
        return self.stored_name(name) in self.folder

    def blocks(self, fp8_blocks: tuple[int, int] | None) -> tuple[int, int]:
        return fp8_blocks or (self.fp8_block, self.fp8_block)

    def raw(
        self, name: str, held: bool = True, fp8_blocks: tuple[int, int] | None = None
    ) -> tuple[np.ndarray, np.ndarray | None, str | None]:
        """(the tensor as stored, its ue8m0 scale bytes or None, its format: FP8 e4m3, packed FP4 or None), the
        scale's shape checked against the weight's (FP8 blocks: `fp8_blocks`, else the model's square ones). Not
        `held` (no device of this process holds it): zeros of its shape and dtype, nothing read."""
        stored = self.stored_name(name)
        weight = self.folder.get(stored) if held else self.folder.placeholder(stored)
        where = f"{self.folder.file_of(stored)}: tensor {stored!r}"
        scale_stored = scale_name(stored) if stored.endswith(".weight") else None
        if scale_stored is None or scale_stored not in self.folder:
            if scale_stored is not None and weight.dtype in (ml_dtypes.float8_e4m3fn, np.int8, np.uint8):
                raise CheckpointError(
                    f"{where} is {weight.dtype} (quantized) but its scale tensor {scale_stored!r} is missing"
                )
            return weight, None, None
        scale = self.folder.get(scale_stored) if held else self.folder.placeholder(scale_stored)
        if weight.dtype not in (ml_dtypes.float8_e4m3fn, np.int8, np.uint8):
            raise CheckpointError(f"{where} has a scale but dtype {weight.dtype}, neither FP8 e4m3 nor packed FP4")
        if weight.ndim != 2:
            raise CheckpointError(f"{where} is quantized but has shape {list(weight.shape)}; only 2-D weights are")
        o, i = weight.shape
        if weight.dtype == ml_dtypes.float8_e4m3fn:
            rows, cols = self.blocks(fp8_blocks)
            need, fmt = (-(-o // rows), -(-i // cols)), FP8_E4M3
        else:
            need, fmt = (o, -(-2 * i // FP4_BLOCK)), FP4
        if scale.shape != need:
            raise CheckpointError(
                f"{self.folder.file_of(scale_stored)}: tensor {scale_stored!r} has shape "
                f"{list(scale.shape)}, but its weight {stored!r} of shape {list(weight.shape)} "
                f"({weight.dtype}) needs scales of shape {list(need)}"
            )
        return weight, scale, fmt

    def get(self, name: str, held: bool = True, fp8_blocks: tuple[int, int] | None = None) -> np.ndarray:
        """The tensor in float32 when it is quantized (FP8 or packed FP4 beside a `.scale`), else as stored."""
        weight, scale, fmt = self.raw(name, held, fp8_blocks)
        if fmt is None:
            return weight
        assert scale is not None  # raw gives a scale with every format
        if fmt == FP8_E4M3:
            return dequantize_fp8(weight, scale, self.blocks(fp8_blocks))
        return dequantize_fp4(weight, scale)

    def get_quantized(
        self, name: str, fmt: str, held: bool = True, fp8_blocks: tuple[int, int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(codes, ue8m0 scale bytes as uint8) of a tensor the config keeps in `fmt`; FP4 codes as uint8."""
        weight, scale, found = self.raw(name, held, fp8_blocks)
        if found != fmt:
            stored = self.stored_name(name)
            raise CheckpointError(
                f"{self.file_of(name)}: tensor {stored!r} is stored as {found or weight.dtype}, "
                f"but config.json (quantization_config / expert_dtype) says {fmt}; load it with "
                "--quantization none"
            )
        assert scale is not None  # raw gives a scale with every format, and `found` is one
        codes = weight.view(np.uint8) if fmt == FP4 else weight
        return codes, scale.view(np.uint8)

    def file_of(self, name: str) -> Path:
        return self.folder.file_of(self.stored_name(name))


# ---- the loader --------------------------------------------------------------------------------------------------


def check_complete(reader: TensorReader, needed: list[Source], folder: Path) -> None:
    """Every tensor the config needs is present (all missing names in one error), before anything is read."""
    missing = [reader.stored_name(n) for source in needed for n in source.names if n not in reader]
    if missing:
        shown = ", ".join(missing[:50]) + (f", ... ({len(missing)} in all)" if len(missing) > 50 else "")
        raise CheckpointError(f"{folder}: {len(missing)} tensors missing from the checkpoint: {shown}")


def read_leaf(
    reader: TensorReader, source: Source, info: ArrayInfo | Quantized, path: str, held: set[int] | None = None
) -> np.ndarray | Quantized:
    """One Weights leaf from its checkpoint tensors, each shape-checked (the error names file and tensor). `held`:
    the routed experts this process's devices hold, for a leaf stacked from one tensor per expert; the others are
    not read (zeros stand in for them, never placed on a device). None: every tensor."""
    if isinstance(info, Quantized):
        return _read_quantized(reader, source, info, path, held)
    arrays = []
    for i, (name, need) in enumerate(zip(source.names, source.shapes(info.shape))):
        array = reader.get(name, held is None or i in held, source.fp8_blocks)
        if array.shape != need:
            stored = reader.stored_name(name)
            shape = list(reader.folder.shape(stored))
            unpacked = f" ({list(array.shape)} dequantized)" if list(array.shape) != shape else ""
            raise CheckpointError(
                f"{reader.file_of(name)}: tensor {stored!r} has shape {shape}{unpacked}; "
                f"the config needs {list(need)} (for {path})"
            )
        arrays.append(array)
    return source.build(arrays).astype(info.dtype, copy=False)


def _read_quantized(
    reader: TensorReader, source: Source, info: Quantized, path: str, held: set[int] | None
) -> Quantized:
    """A weight kept quantized: its tensors' codes laid out like the leaf, their scales like the leaf's blocks."""
    codes, scales = [], []
    for i, (name, need) in enumerate(zip(source.names, source.shapes(info.shape))):
        tensor_codes, tensor_scales = reader.get_quantized(
            name, info.format, held is None or i in held, source.fp8_blocks
        )
        packed = (need[0], need[1] // 2) if info.format == FP4 else need
        if tensor_codes.shape != packed:
            stored = reader.stored_name(name)
            raise CheckpointError(
                f"{reader.file_of(name)}: tensor {stored!r} has shape {list(tensor_codes.shape)}; "
                f"the config needs {list(packed)} ({info.format}, for {path})"
            )
        codes.append(tensor_codes)
        scales.append(tensor_scales)
    release_blocks = (1, FP4_BLOCK) if info.format == FP4 else reader.blocks(source.fp8_blocks)
    return Quantized(
        np.ascontiguousarray(source.build(codes)),
        _leaf_scales(source, info, scales, path, release_blocks),
        info.format,
        info.blocks,
    )


def _leaf_scales(
    source: Source, info: Quantized, scales: list[np.ndarray], path: str, release_blocks: tuple[int, int]
) -> np.ndarray:
    """The tensors' block scales laid out like the leaf's blocks (`info.blocks` along its axes).

    A layout that only transposes and stacks moves whole blocks, so it lays the scale grids out directly. One that
    reshapes may merge or split blocks across axes: the scales are expanded to one per element, laid out like the
    weight, and read back at the start of each of the leaf's blocks, checking that each block has one scale."""
    rows, cols = release_blocks
    if not source.layout.reshapes:
        out = source.build(scales)
    else:
        shapes = source.shapes(info.shape)
        per_element = source.build(
            [np.repeat(np.repeat(s, rows, 0), cols, 1)[:o, :i] for s, (o, i) in zip(scales, shapes)]
        )
        out = per_element[tuple(slice(None, None, b) for b in info.blocks)]
        expanded = out
        for axis, (b, n) in enumerate(zip(info.blocks, info.shape)):
            expanded = np.repeat(expanded, b, axis=axis)[(slice(None),) * axis + (slice(0, n),)]
        if not np.array_equal(expanded, per_element):
            raise CheckpointError(
                f"{path}: the release's {rows}x{cols} scale blocks do not map onto blocks of "
                f"{list(info.blocks)} in our layout; load it with --quantization none"
            )
    if out.shape != info.scales.shape:
        raise CheckpointError(
            f"{path}: scales laid out as {list(out.shape)}, the model needs {list(info.scales.shape)}"
        )
    return np.ascontiguousarray(out)


def load_weights(
    folder: str | Path, cfg: ModelConfig | None = None, shardings: Weights | None = None, show_progress: bool = False
) -> tuple[Weights, ModelConfig]:
    """Read a checkpoint folder into Weights (placed with `shardings` when given), one tensor at a time: each leaf
    goes onto the devices (into its layer stack) before the next is read."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: checkpoint folder not found")
    cfg = cfg or load_config(folder)
    reader = TensorReader(SafetensorsFolder(folder), cfg.fp8_block)
    leaves = release_leaves(cfg)
    sources = weight_sources(cfg)

    apart = drafter_folder(folder) if cfg.dspark_drafting else None
    drafter_reader = TensorReader(SafetensorsFolder(apart), cfg.fp8_block) if apart is not None else reader

    def reader_of(name: str) -> TensorReader:
        return drafter_reader if name.startswith(DRAFTER_PREFIXES) else reader

    for part, part_folder in ((reader, folder), (drafter_reader, apart)):
        if part_folder is not None:
            check_complete(part, [sources[leaf.name] for leaf in leaves if reader_of(leaf.name) is part], part_folder)
    if apart is not None or not (cfg.dspark_drafting or cfg.mtp_layers):
        unread = [k for k in reader.folder.keys() if k.removeprefix("model.").startswith(DRAFTER_PREFIXES)]
        if unread:
            kind = "DSpark drafter" if cfg.dspark is not None and apart is None else "MTP"
            log.info("skipping %d %s tensors (nothing drafts with them: see --speculative-config)", len(unread), kind)

    builder = WeightsBuilder(cfg, shardings)
    started = time.perf_counter()
    nbytes = 0.0
    skipped: list[tuple[str, int, int]] = []  # (leaf, experts held, experts) where this process holds only some
    for count, leaf in enumerate(leaves, start=1):
        source = sources[leaf.name]
        held = builder.held_rows(leaf.name) if source.layout is EXPERTS_TRANSPOSED else None
        if held is not None:
            skipped.append((leaf.name, len(held), len(source.names)))
        array = read_leaf(reader_of(leaf.name), source, leaf.stored, leaf.name, held)
        share = 1.0 if held is None else len(held) / len(source.names)  # what was read, not the zeros beside it
        nbytes += share * sum(part.nbytes for part in jax.tree.leaves(array))
        builder.put(leaf.name, leaf.padded(array))  # zero rows up to the padded vocabulary (none elsewhere)
        if show_progress:
            progress("loading weights", count, len(leaves), started)
    weights = builder.finish()
    if skipped:
        name, held_count, total = skipped[0]
        log.info(
            "read %d of %d routed experts in each of %d expert weights (%s, ...): the other processes' devices hold "
            "the rest",
            held_count,
            total,
            len(skipped),
            name,
        )
    log.info("loaded %d tensors, %.2f GiB, in %.1f s", len(leaves), nbytes / 2**30, time.perf_counter() - started)
    return weights, cfg
