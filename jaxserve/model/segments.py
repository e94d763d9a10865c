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
    attention: str  # SWA | CSA | HCA
    hashed: bool  # routed by the token -> experts table instead of top-k


@dataclass(frozen=True)
class Segment:
    start: int  # the first layer
    pattern: tuple[LayerKind, ...]  # the kinds of consecutive layers, repeated
    repeats: int

    def layer(self, repeat: int, position: int) -> int:
        """The model layer at `position` of the pattern in its `repeat`-th repetition."""
        return self.start + repeat * len(self.pattern) + position


def layer_kinds(cfg: ModelConfig) -> tuple[LayerKind, ...]:
    return tuple(LayerKind(a, h) for a, h in zip(cfg.layer_kinds, cfg.hash_layers))


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
                options.append((length + bodies, 1 + count, (Segment(start, pattern, repeats),) + rest))
                if kinds[stop : stop + length] != pattern:
                    break
                repeats += 1
        best[start] = min(options, key=lambda option: option[:2])
    return best[0][2]
