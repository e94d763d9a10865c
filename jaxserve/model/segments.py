"""The layer plan: the model's layers split into segments, each one pattern of layer kinds repeated, so that the
forward compiles one body per layer kind and scans it over the repeats (compile time nearly independent of depth).

A layer's kind is everything that changes its pytree structure or its traced code: the attention kind (SWA, CSA,
HCA) and the routing (the fixed hash table or top-k). DeepSeek-V4-Flash (43 layers: 2 SWA, 20 x (CSA, HCA), CSA;
the first 3 hash-routed) becomes [SWA hash] x 2, [CSA hash] x 1, [HCA, CSA] x 20: four compiled layer bodies.

Weights and cache follow the plan: segment s, position p of its pattern holds the leaves of layers
`s.layer(0, p), s.layer(1, p), ...` stacked along a leading `layers` axis.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from jaxserve.config import ModelConfig


@dataclass(frozen=True)
class LayerKind:
    attention: str  # SWA | CSA | HCA | CSA2 (DeepSeek-V4.1)
    hashed: bool  # routed by the token -> experts table instead of top-k
    # DeepSeek-V4.1 (ModelConfig.shared_kv, .engram): the compress ratio, whether the layer owns the compressor its
    # group shares (a KV source), scores the indexer (an index source), makes or reads the candidate blocks of the
    # two-level top-k ("source" | "uses" | ""), and its place among the Engram layers (-1: not one).
    rate: int = 0
    kv_source: bool = False
    index_source: bool = False
    candidates: str = ""
    engram: int = -1


@dataclass(frozen=True)
class Segment:
    start: int  # the first layer
    pattern: tuple[LayerKind, ...]  # the kinds of consecutive layers, repeated
    repeats: int

    def layer(self, repeat: int, position: int) -> int:
        """The model layer at `position` of the pattern in its `repeat`-th repetition."""
        return self.start + repeat * len(self.pattern) + position


def layer_kinds(cfg: ModelConfig) -> tuple[LayerKind, ...]:
    kv = cfg.shared_kv
    if kv is None:
        return tuple(LayerKind(a, h) for a, h in zip(cfg.layer_kinds, cfg.hash_layers))
    engram = cfg.engram.layer_ids if cfg.engram is not None else ()
    return tuple(
        LayerKind(
            attention,
            hashed=False,
            rate=kv.ratios[i],
            kv_source=i in kv.kv_sources,
            index_source=i in kv.index_sources,
            candidates="source" if i == kv.candidate_source else "uses" if kv.uses_candidates(i) else "",
            engram=engram.index(i) if i in engram else -1,
        )
        for i, attention in enumerate(cfg.layer_kinds)
    )


def _self_contained(cfg: ModelConfig, start: int, length: int, repeats: int) -> bool:
    """Whether a segment's traced body has what each of its layers reads from the layers before it (DeepSeek-V4.1's
    CSA2): a compressed layer's top-k picks come from an index source earlier in the same repeat (picks live only
    within one pass of the body), its entries from a KV source earlier in the same repeat or before the segment."""
    kv = cfg.shared_kv
    if kv is None:
        return True
    for repeat in range(repeats):
        first = start + repeat * length
        for layer in range(first, first + length):
            if not kv.ratios[layer]:
                continue
            if kv.index_source_of(layer) < first or start <= kv.source_of(layer) < first:
                return False
    return True


@functools.cache
def layer_segments(cfg: ModelConfig) -> tuple[Segment, ...]:
    """The split into segments that compiles the fewest layer bodies (the sum of the pattern lengths), and among
    those the fewest segments: an exact search over every start, pattern length and repeat count."""
    kinds = layer_kinds(cfg)
    n = len(kinds)
    # best[i]: (bodies, segments, the split) of the layers from i on.
    best: list[tuple[int, int, tuple[Segment, ...]]] = [(0, 0, ())] * (n + 1)
    for start in range(n - 1, -1, -1):
        options = []
        for length in range(1, n - start + 1):
            pattern = kinds[start : start + length]
            repeats = 1
            while True:
                stop = start + repeats * length
                bodies, count, rest = best[stop]
                if _self_contained(cfg, start, length, repeats):
                    options.append((length + bodies, 1 + count, (Segment(start, pattern, repeats),) + rest))
                if kinds[stop : stop + length] != pattern:
                    break
                repeats += 1
        # No option: no segment may start here (a V4.1 layer that reads picks made before it).
        best[start] = min(options, key=lambda option: option[:2]) if options else (n + 1, n + 1, ())
    return best[0][2]
