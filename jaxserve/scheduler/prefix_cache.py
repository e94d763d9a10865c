"""The prefix cache: content-addressed KV pages shared by every request whose prompt starts with them, and the
sequence-state snapshots a hit starts from (docs/architecture.md, "Prefix caching").

The owner of the KV pages: every page a request holds comes from here and goes back here. A full page of a prompt
is keyed by a hash chain of the tokens up to its end (and the model's salt: anything else that changes its
contents), registered once the step that writes it is scheduled, reference-counted while requests hold it and kept
after its last holder finishes, least recently used first out when pages are needed.

Pages hold the compressed entries and indexer keys, which depend only on the tokens up to the page's end; a
sequence's window ring and compressor state are not paged. A hit therefore needs, where the shared pages end, a
snapshot of that state: a prefill row writes one at the last page boundary its chunk crosses (the model writes the
state as of that position into a spare state row), and the first chunk of a request that hits reads its state from
it. A snapshot costs one sequence's fixed state, so snapshots are fewer than pages and have their own LRU.
Rebuilding the state by prefilling the W tokens before the boundary would not be exact: each layer's window reaches
W tokens back into the layer below, so the rebuild would have to start W tokens back per layer (43 x 128 on Flash).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxserve.paging import pages_needed
from jaxserve.request import Request
from jaxserve.request.step import StepRow
from jaxserve.scheduler.allocator import IdAllocator


@dataclass(eq=False)
class CachedPage:
    """A full page of some prompt, addressed by `key` (the hash chain up to its end)."""

    key: bytes
    page: int
    holders: int = 0  # requests that hold it; 0: kept in the LRU until evicted
    snapshot: int | None = None  # the state row holding the sequence state at its end (a hit can start there)
    keyed: bool = True  # found by its key (False once the cache forgot it: it goes when its last holder does)


@dataclass
class _Chain:
    """A request's view of its prompt: the keys of its full pages (those a hit may cover), and how many of them
    are registered in the cache (or known to be there already)."""

    keys: list[bytes]
    registered: int = 0
    # state rows a scheduled chunk writes a snapshot into: page index -> row (registered at commit)
    snapshots: dict[int, int] = field(default_factory=dict)
    read_row: int | None = None  # the snapshot a hit starts from, read by its first chunk


@dataclass(frozen=True)
class PrefixStats:
    queries: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
    hits: int = 0  # of them, tokens found in the cache (vLLM's prefix_cache_hits)


class PrefixCache:
    def __init__(
        self,
        pages: IdAllocator,
        page_size: int,
        snapshot_rows: list[int] | None = None,
        salt: bytes = b"",
        pages_only: bool = False,
    ):
        """`snapshot_rows`: the state rows kept for snapshots (none or empty: prefix caching is off, and this is the
        plain page allocator, unless `pages_only`); `salt`: what else makes a page's contents (the model, the KV
        storage dtype); `pages_only`: pages are cached without snapshots (a decode server's: a remote request's
        sequence state arrives whole, only its pages may be here already)."""
        self.pages = pages
        self.page_size = page_size
        self.enabled = bool(snapshot_rows) or pages_only
        self._snapshot_rows = list(snapshot_rows or ())
        self._free_snapshots = list(reversed(self._snapshot_rows))
        self._root = hashlib.blake2b(salt, digest_size=16).digest()
        self._by_key: dict[bytes, CachedPage] = {}
        self._by_page: dict[int, CachedPage] = {}
        self._unheld: OrderedDict[CachedPage, None] = OrderedDict()  # evictable pages, least recently used first
        self._snapshotted: OrderedDict[CachedPage, None] = OrderedDict()  # pages with a snapshot, LRU first
        self._chains: dict[Request, _Chain] = {}  # admitted requests
        self._waiting_keys: dict[Request, list[bytes]] = {}  # the keys of requests admission turned away so far
        self.stats = PrefixStats()

    # ---- what admission asks ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation can have: free ones and cached ones nobody holds."""
        return self.pages.num_free + len(self._unheld)

    @property
    def num_cached(self) -> int:
        """Pages the cache keeps (held or not)."""
        return len(self._by_page)

    def cached(self, page: int) -> CachedPage | None:
        """The cache's record of `page` (None: a request's own page, or free)."""
        return self._by_page.get(page)

    @property
    def num_held(self) -> int:
        """Pages requests hold (the KV usage gauge)."""
        return self.pages.size - self.num_free

    def admit(self, request: Request) -> bool:
        """Give `request` every page it can ever need, sharing the cached pages its prompt starts with, and start
        its prefill after them (a remote request's state arrives for the pages after them); False (nothing taken)
        when the pool cannot hold the rest yet."""
        keys = self._waiting_keys.get(request)
        if keys is None:
            keys = self._waiting_keys[request] = self._keys(request) if self.enabled else []
        hit = self._lookup(request, keys)
        need = pages_needed(request.max_total_len, self.page_size) - len(hit)
        reused = sum(1 for cached in hit if cached.holders == 0)  # cached pages this request takes out of the LRU
        if need > self.num_free - reused:
            return False  # its keys stay known while it waits
        del self._waiting_keys[request]
        for cached in hit:
            self._hold(cached)
        request.pages = [cached.page for cached in hit] + self._allocate(need)
        chain = self._chains[request] = _Chain(keys, registered=len(hit))
        if hit and not request.remote:
            last = hit[-1]
            assert last.snapshot is not None  # _lookup ends a local request's hit on a snapshot
            chain.read_row = last.snapshot
            self._snapshotted.move_to_end(last)
        if hit:
            request.num_prefilled = request.num_cached_tokens = len(hit) * self.page_size
        if self.enabled:
            self.stats = PrefixStats(
                self.stats.queries + request.prompt_len, self.stats.hits + len(hit) * self.page_size
            )
        return True

    def chunk(self, request: Request, start: int, length: int) -> StepRow:
        """The prefill row of `request`'s tokens [start, start + length): the first one after a hit reads the
        snapshot; one that crosses a page boundary the cache has no snapshot for yet writes one at the last such
        boundary it crosses."""
        chain = self._chains[request]
        read_row, chain.read_row = chain.read_row, None
        boundary = (start + length) // self.page_size  # full pages once this chunk is in
        snapshot = None
        if self.enabled and boundary * self.page_size > start and 0 < boundary <= len(chain.keys):
            cached = self._by_key.get(chain.keys[boundary - 1])
            row = self._take_snapshot_row() if cached is None or cached.snapshot is None else None
            if row is not None:
                chain.snapshots[boundary - 1] = row
                snapshot = (row, boundary * self.page_size - start)
        return StepRow.chunk(request, start, length, read_row=read_row, snapshot=snapshot)

    def commit(self, rows: Sequence[StepRow]) -> None:
        """Register the full pages and snapshots a step's prefill `rows` write, once the step is decided: a request
        admitted after this can share them (its steps run after this one on the device)."""
        for row in rows:
            chain = self._chains.get(row.request)
            if chain is None or not self.enabled:
                continue
            self._register_chain(row.request, chain, (row.start + row.length) // self.page_size)
            for index, state_row in list(chain.snapshots.items()):
                del chain.snapshots[index]
                cached = self._by_key.get(chain.keys[index])
                if cached is None or cached.snapshot is not None:  # another request's is there already
                    self._free_snapshots.append(state_row)
                else:
                    cached.snapshot = state_row
                    self._snapshotted[cached] = None

    def arrived(self, request: Request) -> None:
        """A remote request's state arrived in its pages: every full page of its prompt can be shared now."""
        chain = self._chains[request]
        if self.enabled:
            self._register_chain(request, chain, len(chain.keys))

    def _register_chain(self, request: Request, chain: _Chain, full: int) -> None:
        """Register `request`'s prompt pages up to `full` (the cached pages its prompt starts with end there)."""
        full = min(full, len(chain.keys))
        for index in range(chain.registered, full):
            self._register(chain.keys[index], request.pages[index])
        chain.registered = max(chain.registered, full)

    def release(self, request: Request) -> None:
        """Take back `request`'s pages, each exactly once: cached ones stay cached (the last first out), the rest
        are free again."""
        self._waiting_keys.pop(request, None)
        chain = self._chains.pop(request, None)
        if chain is not None:
            self._free_snapshots.extend(chain.snapshots.values())  # written by a step never committed
        pages, request.pages = request.pages, []
        private = []
        for page in reversed(pages):  # a chain's deepest page is evicted before the pages it continues
            cached = self._by_page.get(page)
            if cached is None:
                private.append(page)
                continue
            cached.holders -= 1
            if cached.holders == 0:
                if cached.keyed:
                    self._unheld[cached] = None
                else:
                    del self._by_page[page]
                    private.append(page)
        self.pages.free(private)

    def clear(self) -> None:
        """Forget every cached page and snapshot (after a failed step: what it was to write may not be there):
        pages nobody holds are free again, held ones go when their last holder does."""
        for cached in list(self._unheld):
            self._evict(cached)
        for cached in self._by_page.values():
            cached.keyed = False
            self._drop_snapshot(cached)
        self._by_key.clear()
        for chain in self._chains.values():
            chain.registered = len(chain.keys)  # nothing of theirs is registered any more, nor will be
            chain.read_row = None

    def check_books(self) -> None:
        """Raise AssertionError unless the books balance: every page is free, cached, or held by the requests that
        list it (a cached page's holder count is theirs), the LRU holds exactly the cached pages nobody holds, and
        every snapshot row is free, attached to one cached page, or being written by one scheduled chunk."""
        holders: dict[int, int] = {}
        for request in self._chains:
            for page in request.pages:
                holders[page] = holders.get(page, 0) + 1
        private = [page for page in holders if page not in self._by_page]
        assert all(holders[page] == 1 for page in private), "a request's own page is listed twice"
        for page, cached in self._by_page.items():
            assert cached.page == page and cached.holders == holders.get(page, 0), (page, cached.holders)
            assert (cached in self._unheld) == (cached.holders == 0), page
            assert not cached.keyed or self._by_key.get(cached.key) is cached, page
        assert self.pages.num_used == len(private) + len(self._by_page), "a page is lost or counted twice"
        attached = [cached.snapshot for cached in self._snapshotted if cached.snapshot is not None]
        assert len(attached) == len(self._snapshotted), "a page without a snapshot is in the snapshots' LRU"
        pending = [row for chain in self._chains.values() for row in chain.snapshots.values()]
        rows = self._free_snapshots + attached + pending
        assert sorted(rows) == sorted(self._snapshot_rows), "a snapshot row is lost or counted twice"

    # ---- internals -------------------------------------------------------------------------------------------
    def _keys(self, request: Request) -> list[bytes]:
        """The hash chain of the prompt's full pages that a hit may cover: all but a last page ending the prompt
        (its last token must run, to sample after it)."""
        ids, size = request.prompt_ids, self.page_size
        keys, key = [], self._root
        for start in range(0, (len(ids) - 1) // size * size, size):
            page = np.asarray(ids[start : start + size], np.int32).tobytes()
            key = hashlib.blake2b(key + page, digest_size=16).digest()
            keys.append(key)
        return keys

    def _lookup(self, request: Request, keys: list[bytes]) -> list[CachedPage]:
        """The longest run of cached pages the prompt starts with that ends on a snapshot, or any run for a remote
        request (its sequence state arrives whole); a request that wants every prompt token's logprobs takes none:
        they are computed only where the prompt runs."""
        if request.sampling.prompt_logprobs is not None:
            return []
        found: list[CachedPage] = []
        end = 0
        for key in keys:
            cached = self._by_key.get(key)
            if cached is None:
                break
            found.append(cached)
            if cached.snapshot is not None or request.remote:
                end = len(found)
        return found[:end]

    def _hold(self, cached: CachedPage) -> None:
        if cached.holders == 0:
            del self._unheld[cached]
        cached.holders += 1

    def _register(self, key: bytes, page: int) -> None:
        cached = self._by_key.get(key)
        if cached is not None:
            return  # computed by another request too: its page stays that request's own
        cached = self._by_key[key] = self._by_page[page] = CachedPage(key, page, holders=1)

    def _allocate(self, n: int) -> list[int]:
        while self.pages.num_free < n and self._unheld:
            self._evict(next(iter(self._unheld)))
        return self.pages.allocate(n)

    def _evict(self, cached: CachedPage) -> None:
        del self._unheld[cached]
        del self._by_key[cached.key]
        del self._by_page[cached.page]
        self._drop_snapshot(cached)
        self.pages.free([cached.page])

    def _drop_snapshot(self, cached: CachedPage) -> None:
        if cached.snapshot is not None:
            self._free_snapshots.append(cached.snapshot)
            cached.snapshot = None
            del self._snapshotted[cached]

    def _take_snapshot_row(self) -> int | None:
        """A free snapshot row, the least recently used snapshot dropped for it if need be (None: every row is
        being written by a chunk scheduled in this step)."""
        if not self._free_snapshots and self._snapshotted:
            self._drop_snapshot(next(iter(self._snapshotted)))
        return self._free_snapshots.pop() if self._free_snapshots else None
