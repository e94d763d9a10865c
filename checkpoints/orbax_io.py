"""DeepSeek-V4 safetensors folder -> a sharded orbax checkpoint, converted once, restored straight into any mesh.

Layout of a conversion (jax-llm-examples' per-layer layout): one orbax item per layer (`layer_00`, ...), one for
the rest of the backbone (`misc`: embeddings, final norm, HC head, LM head) and one per drafter the checkpoint
ships (`drafter_mtp`: the first MTP block; `drafter_dspark`: the DSpark stages and heads), each a flat dict keyed by
the leaf's release name (`layers.3.attn.wq_b`, see `release_leaves`; a weight kept quantized is two entries,
`....wq_b.codes` and `....wq_b.scales`, so a conversion keeps the checkpoint's FP8 / FP4 as the engine holds them);
beside them config.json (a DSpark drafter kept beside the checkpoint keeps its own, in `dspark/`), the tokenizer
files and `jaxserve_orbax.json`, the marker (format, dtype, the drafters held) written last, so a conversion that
stopped half way is never mistaken for a checkpoint.

Orbax API: the stable v0 `ocp.StandardCheckpointer`. Restoring with a target of ShapeDtypeStructs carrying
NamedShardings makes every device read only its own shards, on 8 fake CPU devices as on accelerators, so a
changed mesh needs no re-conversion. v1 (`ocp.v1`) is still `experimental` in orbax 0.12.8.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from jaxserve.checkpoints.deepseek import (
    DRAFTER_PREFIXES,
    DSPARK_FOLDER,
    TensorReader,
    check_complete,
    drafter_folder,
    drafting_config,
    read_leaf,
    weight_sources,
    with_drafter_apart,
)
from jaxserve.checkpoints.safetensors_file import CheckpointError, SafetensorsFolder
from jaxserve.checkpoints.writer import write_config
from jaxserve.config import ConfigError, ModelConfig, load_config
from jaxserve.kernels.quant import Quantized
from jaxserve.model.sharding import shape_dtype_structs, shardings_for
from jaxserve.model.stacking import WeightsBuilder
from jaxserve.model.weights import LayerLeaf, Weights, abstract_weights, release_leaves
from jaxserve.progress import progress

log = logging.getLogger("jaxserve.checkpoints")

MARKER = "jaxserve_orbax.json"
FORMAT_VERSION = 1
MISC = "misc"
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _checkpointer():
    # Imported here: orbax takes ~0.25 s to import, and a server loading safetensors never needs it.
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def is_orbax_checkpoint(path: str | Path) -> bool:
    """Whether `path` holds a finished `convert_checkpoint` output (its marker is written last)."""
    return (Path(path) / MARKER).is_file()


def drafter_of(cfg: ModelConfig) -> str | None:
    """The drafter `cfg` holds ("mtp", "dspark"; None: none), as `ModelConfig.with_drafter` names it."""
    return "dspark" if cfg.dspark_drafting else "mtp" if cfg.mtp_layers else None


def _item_name(name: str, drafter: str | None) -> str:
    """The orbax item a leaf lives in: 'layers.3.attn.wq_b' -> 'layer_03', a drafter's 'mtp.0.e_proj' ->
    'drafter_mtp', 'embed' -> 'misc'."""
    if name.startswith(DRAFTER_PREFIXES):
        return f"drafter_{drafter}"
    return f"layer_{int(name.split('.')[1]):02d}" if name.startswith("layers.") else MISC


def _by_item(cfg: ModelConfig) -> dict[str, dict[str, LayerLeaf]]:
    """The un-stacked model's leaves as {item: {release name: leaf}}, items and leaves in release order."""
    items: dict[str, dict[str, LayerLeaf]] = {}
    for leaf in release_leaves(cfg):
        items.setdefault(_item_name(leaf.name, drafter_of(cfg)), {})[leaf.name] = leaf
    return items


# ---- converting ----------------------------------------------------------------------------------------------------


def _parts(name: str, value: Any) -> dict[str, Any]:
    """A leaf's orbax entries: itself, or a quantized weight's codes and scales ('name.codes', 'name.scales')."""
    if isinstance(value, Quantized):
        return {f"{name}.codes": value.codes, f"{name}.scales": value.scales}
    return {name: value}


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    show_progress: bool = False,
    quantization: str = "auto",
) -> Path:
    """Convert the safetensors folder `src` into an orbax checkpoint at `dst`, leaves in `dtype` as the engine holds
    them (`quantization="auto"`: kept as the checkpoint ships them). One layer is read, written and dropped at a
    time, so host memory peaks at about one layer."""
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if not src.is_dir():
        raise CheckpointError(f"{src}: checkpoint folder not found")
    cfg = load_config(src).with_dtype(dtype).with_quantization(quantization)
    reader = TensorReader(SafetensorsFolder(src), cfg.fp8_block)
    sources = weight_sources(cfg)
    items = {item: (leaves, reader, sources) for item, leaves in _by_item(cfg).items()}
    check_complete(reader, [sources[name] for leaves, _, _ in items.values() for name in leaves], src)
    drafters = _drafters(src, cfg, reader)
    for method, (drafter_cfg, drafter_reader) in drafters.items():
        drafter_leaves = _by_item(drafter_cfg)[f"drafter_{method}"]
        items[f"drafter_{method}"] = (drafter_leaves, drafter_reader, weight_sources(drafter_cfg))
    _clear_destination(src, dst, overwrite)

    started = time.perf_counter()
    with _checkpointer() as checkpointer:
        for done, (item, (leaves, item_reader, item_sources)) in enumerate(items.items(), start=1):
            arrays = {}
            for name, leaf in leaves.items():
                # As the checkpoint stores it (its own vocabulary): a conversion is restored into any mesh.
                arrays.update(_parts(name, read_leaf(item_reader, item_sources[name], leaf.stored, name)))
            checkpointer.save(dst / item, arrays)
            checkpointer.wait_until_finished()  # the save is async; waiting keeps one layer in memory, not two
            if show_progress:
                progress("converting", done, len(items), started)
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    write_config(cfg, dst)  # with the formats the leaves were written in
    if (apart := drafter_folder(src)) is not None and "dspark" in drafters:  # kept beside the backbone, as there
        (dst / DSPARK_FOLDER).mkdir()
        shutil.copyfile(apart / "config.json", dst / DSPARK_FOLDER / "config.json")
    marker = {"format_version": FORMAT_VERSION, "dtype": dtype, "drafters": sorted(drafters)}
    (dst / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return dst


def _drafters(src: Path, cfg: ModelConfig, reader: TensorReader) -> dict[str, tuple[ModelConfig, TensorReader]]:
    """The drafters `src` ships, each as (the config holding it, the reader of its tensors): its first MTP block,
    its DSpark drafter (in its tensors, or kept beside them in DSPARK_FOLDER). One the config declares but whose
    tensors are missing is left out, loudly."""
    found: dict[str, tuple[ModelConfig, TensorReader]] = {}
    with_dspark = with_drafter_apart(cfg, src)
    apart = drafter_folder(src) if with_dspark is not cfg else None  # the drafter's config, so its tensors, beside
    dspark_reader = reader if apart is None else TensorReader(SafetensorsFolder(apart), cfg.fp8_block)
    candidates = {"mtp": (cfg, reader), "dspark": (with_dspark, dspark_reader)}
    for method, (base, method_reader) in candidates.items():
        try:
            drafter_cfg = base.with_drafter(method)
        except ConfigError:
            continue  # the checkpoint declares no such drafter
        sources = weight_sources(drafter_cfg)
        names = _by_item(drafter_cfg)[f"drafter_{method}"]
        try:
            check_complete(method_reader, [sources[name] for name in names], src)
        except CheckpointError as missing:
            log.warning("%s: the conversion holds no %s drafter: %s", src, method, missing)
            continue
        found[method] = (drafter_cfg, method_reader)
    return found


def _clear_destination(src: Path, dst: Path, overwrite: bool) -> None:
    if src.is_relative_to(dst):  # replacing dst would delete the source
        raise CheckpointError(f"{dst}: holds the source {src}; write the conversion elsewhere")
    if not dst.exists():
        return
    if not overwrite:
        raise CheckpointError(f"{dst}: already exists; pass overwrite=True to replace it")
    if dst.is_dir():
        shutil.rmtree(dst)
    else:
        dst.unlink()


# ---- restoring -----------------------------------------------------------------------------------------------------


def restore_weights(dst: str | Path, cfg: ModelConfig, mesh: Mesh, show_progress: bool = False) -> Weights:
    """Restore a conversion straight into `mesh`: each device reads only the shards its target sharding names, one
    layer at a time, each layer going into its stacks before the next is read. A vocabulary `cfg` pads
    (`cfg.padded_vocab_size`) is read into its padded targets, orbax filling the rows past the stored ones with
    zeros."""
    dst = Path(dst).resolve()
    _check_conversion(dst, cfg)
    items = _by_item(cfg)
    absent = [dst / item for item in items if not (dst / item).is_dir()]
    if absent:
        raise CheckpointError(f"{absent[0]}: layer directory missing ({len(absent)} in all); convert again")

    builder = WeightsBuilder(cfg, shardings_for(abstract_weights(cfg), mesh))
    started = time.perf_counter()
    with _checkpointer() as checkpointer:
        for done, (item, leaves) in enumerate(items.items(), start=1):
            infos = {name: leaf.info for name, leaf in leaves.items()}
            targets = shape_dtype_structs(infos, mesh)
            padded = any(leaf.stored != leaf.info for leaf in leaves.values())
            if padded:  # a non-strict restore pads (or cuts) any array silently: first check what is stored
                _check_stored_shapes(checkpointer, dst / item, leaves)
            restored = checkpointer.restore(
                dst / item,
                {part: target for name, target in targets.items() for part, target in _parts(name, target).items()},
                strict=not padded,
            )
            for name, target in targets.items():
                structure = jax.tree.structure(target)
                builder.put(name, jax.tree.unflatten(structure, [restored[p] for p in _parts(name, target)]))
            if show_progress:
                progress("restoring", done, len(items), started)
    return builder.finish()


def _check_stored_shapes(checkpointer, item: Path, leaves: dict[str, LayerLeaf]) -> None:
    """Every array of an orbax item is stored in the shape its leaf has in a checkpoint (`LayerLeaf.stored`)."""
    stored = checkpointer.metadata(item).item_metadata.tree
    for name, leaf in leaves.items():
        for part, info in _parts(name, leaf.stored).items():
            shape = tuple(stored[part].shape) if part in stored else None
            if shape != info.shape:
                raise CheckpointError(
                    f"{item}: {part} is stored as {'nothing' if shape is None else list(shape)}, the config needs "
                    f"{list(info.shape)}; convert again"
                )


def _check_conversion(dst: Path, cfg: ModelConfig) -> None:
    """The marker's format and dtype, and the converted config.json, must match what is asked for."""
    if not is_orbax_checkpoint(dst):
        raise CheckpointError(f"{dst}: not an orbax conversion (no {MARKER}); run convert_checkpoint first")
    try:
        marker = json.loads((dst / MARKER).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise CheckpointError(f"{dst / MARKER}: not valid JSON ({bad})") from None
    if marker.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{dst / MARKER}: format_version {marker.get('format_version')!r}, this jaxserve "
            f"reads {FORMAT_VERSION}; convert again"
        )
    if marker.get("dtype") != cfg.dtype:
        raise CheckpointError(
            f"{dst / MARKER}: converted as {marker.get('dtype')}, but {cfg.dtype} was asked for; "
            f"load with dtype={marker.get('dtype')!r} or convert again with dtype={cfg.dtype!r}"
        )
    drafter = drafter_of(cfg)
    if drafter is not None and drafter not in marker.get("drafters", ()):
        raise CheckpointError(
            f"{dst}: the conversion holds no {'DSpark drafter' if drafter == 'dspark' else 'MTP block'} (its "
            f"checkpoint shipped none, or it was converted by a jaxserve that converted the backbone only); convert "
            f"again, or serve the safetensors checkpoint, for speculative decoding with method {drafter!r}"
        )
    # The vocabulary's padding is the mesh's (sharding.for_mesh) and the Engram tables' placement the server's,
    # never the conversion's.
    converted = (
        drafting_config(dst, drafter)
        .with_dtype(cfg.dtype)
        .with_vocab_multiple(cfg.vocab_multiple)
        .with_engram_placement("host" if cfg.engram_on_host else "device")
    )
    differing = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(converted, f.name)]
    if differing:
        hint = (
            " (the conversion's quantization: convert again with the --quantization to serve with)"
            if {"linear_format", "expert_format"} & set(differing)
            else ""
        )
        raise CheckpointError(
            f"{dst / 'config.json'}: the converted config differs from the one asked for in "
            f"{', '.join(differing)}{hint}"
        )
