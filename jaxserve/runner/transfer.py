"""One sequence's device state, moved between two servers (prefill/decode disaggregation, docs/architecture.md
"Disaggregated prefill and decode").

The state is every leaf of the runner's device state (jaxserve.runner.speculative.abstract_runner_cache) at the
sequence's places in it: a paged leaf (window-less pools: CSA and HCA entries, the indexer's keys, FP8 codes and
scales packed as they are stored) at its pages, a per-sequence leaf (window ring, compressor and indexer-compressor
state, the drafter's state and position) at its slot's row. The leaves travel as they are stored, so nothing is
re-encoded and a page arrives bit for bit.

- `StateLayout`: which leaves and how each is cut, from the abstract state; the two sides compare theirs.
- `StateMover`: the jitted cuts, per page bucket: `export` (prefill side: the pages from the first one the decode
  side lacks, and the slot's rows, replicated over the mesh), `checksums` (both sides, in checksum mode: of what is
  offered and of what arrived) and `install` (decode side: into its own pages and slot, the cache donated; the
  sharding is the receiving mesh's, whatever the sender's was).
- `TransferPort`: jax.experimental.transfer's server on one device: `offer` a parcel under an id, `pull` one from
  another server by its address and id. A pull from a server that died never completes (jax 0.10.2, CPU), so `pull`
  waits until a deadline and raises TransferFailed.

The checksum of a leaf is two uint32 sums over its bytes: the plain sum and the sum weighted by an odd multiplier per
byte position, so any changed byte changes the weighted sum, and bytes swapped between positions change it too.
"""

from __future__ import annotations

import datetime
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.model.weights import ArrayInfo, is_info

PAGES, SLOTS = "pages", "slots"  # the logical axes a leaf is cut along (jaxserve.model.cache)
_GOLDEN = np.uint32(2654435761)  # Knuth's multiplicative hash constant: byte i weighs 2 * i * _GOLDEN + 1 (odd)


class TransferFailed(RuntimeError):
    """A sequence's state did not arrive whole: the pull failed or timed out, or its bytes do not match the sender's
    checksums."""


@dataclass(frozen=True)
class LeafLayout:
    """One leaf of the state as it travels: cut along `axis` (PAGES: its pages, SLOTS: the sequence's row)."""

    name: str
    shape: tuple[int, ...]  # the whole leaf's
    dtype: str
    axis: int
    kind: str

    def cut(self, pages: int) -> tuple[int, ...]:
        """The shape of the part that travels for `pages` pages."""
        shape = list(self.shape)
        shape[self.axis] = pages if self.kind == PAGES else 1
        return tuple(shape)


@dataclass(frozen=True)
class StateLayout:
    leaves: tuple[LeafLayout, ...]

    @staticmethod
    def of(abstract: Any) -> StateLayout:
        """The layout of a runner's abstract state (ArrayInfo leaves with their logical axes)."""
        leaves, _ = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_info)
        layout = []
        for path, info in leaves:
            assert isinstance(info, ArrayInfo)
            kind = PAGES if PAGES in info.axes else SLOTS
            layout.append(
                LeafLayout(
                    jax.tree_util.keystr(path), info.shape, jnp.dtype(info.dtype).name, info.axes.index(kind), kind
                )
            )
        return StateLayout(tuple(layout))

    def to_json(self) -> list:
        return [[leaf.name, list(leaf.shape), leaf.dtype, leaf.axis, leaf.kind] for leaf in self.leaves]

    def mismatch(self, other_json: list) -> str | None:
        """Why a peer whose layout is `other_json` (to_json's) cannot exchange states with this one (None: it can)."""
        other = [tuple(entry) for entry in other_json]
        mine = [(leaf.name, list(leaf.shape), leaf.dtype, leaf.axis, leaf.kind) for leaf in self.leaves]
        if len(other) != len(mine):
            return f"the peer's state has {len(other)} arrays, this server's {len(mine)} (a drafter on one side?)"
        for theirs, ours in zip(other, mine):
            if tuple(theirs) != tuple(ours):
                return f"state array {ours[0]}: the peer's is {theirs[1:]}, this server's {ours[1:]}"
        return None

    def specs(self, pages: int, device: jax.Device) -> list[jax.ShapeDtypeStruct]:
        sharding = jax.sharding.SingleDeviceSharding(device)
        return [jax.ShapeDtypeStruct(leaf.cut(pages), jnp.dtype(leaf.dtype), sharding=sharding) for leaf in self.leaves]


def checksum(leaf: jax.Array) -> jax.Array:
    """[2] uint32: the sum of the leaf's bytes and their position-weighted sum (module docstring)."""
    data = leaf if leaf.dtype.itemsize == 1 else jax.lax.bitcast_convert_type(leaf, jnp.uint8)
    data = data.reshape(-1).astype(jnp.uint32)
    weights = jnp.arange(data.shape[0], dtype=jnp.uint32) * jnp.uint32(2 * int(_GOLDEN) % 2**32) + jnp.uint32(1)
    return jnp.stack([jnp.sum(data, dtype=jnp.uint32), jnp.sum(data * weights, dtype=jnp.uint32)])


def _index(leaf: LeafLayout, rows: jax.Array) -> tuple:
    return (slice(None),) * leaf.axis + (rows,)


class StateMover:
    """The jitted cuts of one runner's state (module docstring), compiled per page bucket: `buckets`, the page counts
    a parcel is padded to (one compile each; the last a sequence's most pages)."""

    def __init__(self, abstract: Any, shardings: Any, mesh: Mesh, num_pages: int, buckets: tuple[int, ...]):
        self.layout = StateLayout.of(abstract)
        self.num_pages, self.buckets = num_pages, buckets
        self._treedef = jax.tree.structure(abstract, is_leaf=is_info)
        replicated = NamedSharding(mesh, PartitionSpec())
        self._replicated = replicated
        self.device = mesh.devices.flat[0]  # where a parcel is served from and arrives
        self._export = jax.jit(self._export_fn, out_shardings=replicated)
        self._checksums = jax.jit(_checksums)
        self._install = jax.jit(
            self._install_fn, donate_argnames=("cache", "slot_tokens"), out_shardings=(shardings, replicated)
        )

    def _export_fn(self, cache: Any, pages: jax.Array, slot: jax.Array) -> list[jax.Array]:
        return [
            jnp.take(leaf, pages if layout.kind == PAGES else slot[None], axis=layout.axis)
            for layout, leaf in zip(self.layout.leaves, jax.tree.leaves(cache))
        ]

    def _install_fn(self, cache: Any, slot_tokens: jax.Array, parts: list, pages: jax.Array, slot: jax.Array, token):
        leaves = [
            leaf.at[_index(layout, pages if layout.kind == PAGES else slot[None])].set(part, mode="drop")
            for layout, leaf, part in zip(self.layout.leaves, jax.tree.leaves(cache), parts)
        ]
        return jax.tree.unflatten(self._treedef, leaves), slot_tokens.at[slot].set(token)

    def _padded(self, pages: list[int], fill: int) -> tuple[int, np.ndarray]:
        bucket = next(b for b in self.buckets if b >= len(pages))
        return bucket, np.asarray(pages + [fill] * (bucket - len(pages)), np.int32)

    def export(self, cache: Any, pages: list[int], slot: int) -> Parcel:
        """The state at `pages` (padded to their bucket with page 0, never installed) and `slot`'s row."""
        bucket, ids = self._padded(pages, 0)
        parts = self._export(cache, ids, np.int32(slot))
        # Every device holds the parcel whole; the transfer server serves it from the mesh's first.
        first = [next(s.data for s in part.addressable_shards if s.device == self.device) for part in parts]
        return Parcel(first, len(pages), bucket)

    def checksums(self, parts: list[jax.Array]) -> np.ndarray:
        """[leaves, 2] uint32: each part's checksum (a parcel's parts, on one device)."""
        return np.asarray(self._checksums(parts))

    def install(
        self, cache: Any, slot_tokens: jax.Array, parcel: Parcel, pages: list[int], slot: int, token: int
    ) -> tuple[Any, jax.Array]:
        """`cache` and `slot_tokens` (both donated) with the parcel at `pages` (its real ones) and `slot`, whose next
        input token is `token`. Out-of-range page ids pad the bucket, so its padding is dropped."""
        if len(pages) != parcel.pages:
            raise ValueError(f"a parcel of {parcel.pages} pages installed into {len(pages)}")
        _, ids = self._padded(pages, self.num_pages)
        parts = jax.device_put(parcel.parts, self._replicated)
        return self._install(cache, slot_tokens, parts, ids, np.int32(slot), np.int32(token))

    def warm(self, cache: Any, slot_tokens: jax.Array, export: bool, install: bool) -> tuple[Any, jax.Array]:
        """Compile every bucket's cuts this side uses and the checksums, running each once on nothing (page ids and slot
        out of range: dropped): returns the cache and slot tokens (install donates them)."""
        nowhere = np.int32(2**30)
        for bucket in self.buckets:
            if export:
                parts = self.export(cache, [0] * bucket, 0).parts
            else:
                parts = [jnp.zeros(spec.shape, spec.dtype) for spec in self.layout.specs(bucket, self.device)]
            self.checksums(parts)
            if install:
                ids = np.full(bucket, self.num_pages, np.int32)
                parts = jax.device_put(parts, self._replicated)
                cache, slot_tokens = self._install(cache, slot_tokens, parts, ids, nowhere, np.int32(0))
        return cache, slot_tokens


def _checksums(parts: list[jax.Array]) -> jax.Array:
    return jnp.stack([checksum(part) for part in parts]) if parts else jnp.zeros((0, 2), jnp.uint32)


@dataclass
class Parcel:
    """One sequence's state on its way: each leaf's part (padded to `bucket` pages, `pages` of them real), on one
    device."""

    parts: list[jax.Array]
    pages: int
    bucket: int

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


def verify(parcel: Parcel, expected: np.ndarray, found: np.ndarray, layout: StateLayout) -> None:
    """Raise TransferFailed naming every leaf whose arrived bytes do not match the sender's checksums."""
    bad = [leaf.name for leaf, a, b in zip(layout.leaves, expected, found) if tuple(a) != tuple(b)]
    if bad or len(expected) != len(found):
        raise TransferFailed(
            f"the transferred state is corrupt: {len(bad)} of {len(layout.leaves)} arrays differ from the sender's "
            f"checksums ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})"
        )


class TransferPort:
    """jax.experimental.transfer's server on `device` (its client's), listening on `host`."""

    def __init__(self, device: jax.Device, host: str):
        from jax.experimental import transfer  # imported here: only disaggregated servers start one

        self.device = device
        address = f"{host}:0"
        self._server = transfer.start_transfer_server(device.client, address, [address])
        self._connections: dict[str, Any] = {}
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return self._server.address()

    def offer(self, parts: list[jax.Array], timeout_s: float) -> int:
        """Serve `parts` to one pull under the id returned, for up to `timeout_s` seconds."""
        uuid = secrets.randbits(62)
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        self._server.await_pull(uuid, parts, timeout=deadline)
        return uuid

    def pull(self, address: str, uuid: int, specs: list[jax.ShapeDtypeStruct], timeout_s: float) -> list[jax.Array]:
        """The parts offered under `uuid` at `address`, on this port's device; TransferFailed if they have not all
        arrived within `timeout_s` seconds (a pull from a server gone never completes: its buffers are abandoned)."""
        with self._lock:
            connection = self._connections.get(address)
            if connection is None:
                connection = self._connections[address] = self._server.connect(address)
        try:
            parts = connection.pull(uuid, specs)
        except Exception as error:  # noqa: BLE001 - whatever the transport says, the request fails with it
            raise TransferFailed(f"pulling the state from {address} failed: {error}") from error
        deadline = time.monotonic() + timeout_s
        while not all(part.is_ready() for part in parts):
            if time.monotonic() > deadline:
                raise TransferFailed(
                    f"the state from {address} did not arrive within {timeout_s:g} s (the prefill server is gone "
                    "or overloaded)"
                )
            time.sleep(0.002)
        return parts
