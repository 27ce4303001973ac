"""`PagePool`: the serving engine's cache pages on the host, each held by the sequences that
read it, and the prompt prefixes they hold cached for later requests (automatic prefix
caching, as vLLM's KV cache manager does).

- **Keys.** A page is *full* once every one of its ``page_size`` positions holds a computed
  token. A full page is keyed by a hash of its tokens chained onto the key of the page before
  it (`page_keys`), so a key names the whole prefix up to the page's end, not only the
  page's own tokens.
- **Holding.** Pages are reference-counted: a sequence holds each page it reads. A page held
  by none is free. `take` hands out free pages, `match` the cached pages of a prefix (a
  free one among them is held again) and `release` lets go of a sequence's pages.
- **Eviction.** A free page keeps its key: it stays reusable until a page is needed. `take`
  hands out the free page released longest ago (never-used pages first), dropping its key;
  `release` queues a sequence's pages from its last to its first, so a prefix's later pages
  go before the earlier ones that more prompts share.
- Keys are SHA-256 digests (vLLM's collision-safe choice): two prefixes that differ never
  share a key in practice, and a key does not depend on the process (Python's ``hash`` of a
  ``str`` does).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

import pallas_flash as pf

ROOT = b""
"""The key chained onto a sequence's first page."""


def page_keys(tokens: Sequence[int], page_size: int, parent: bytes = ROOT) -> list[bytes]:
    """The keys of the full pages of ``tokens`` (positions from a page boundary on), each
    chained onto the one before it, the first onto ``parent``."""
    keys = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = np.asarray(tokens[start : start + page_size], np.int64).tobytes()
        parent = hashlib.sha256(parent + page).digest()
        keys.append(parent)
    return keys


class PagePool:
    """The pages of a paged cache, who holds them and which prefixes they cache (module doc).

    Args:
      num_pages: pages in the pool.
      caching: whether full pages are kept for later prompts (`cache` keys none otherwise).
    """

    def __init__(self, num_pages: int, caching: bool = True) -> None:
        if num_pages < 1:
            raise pf.InvalidInputError(f"num_pages: expected a positive int, got {num_pages}")
        self.num_pages, self.caching = num_pages, caching
        self._holders = [0] * num_pages
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(num_pages)
        )  # the next page to take first
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}

    @property
    def free(self) -> int:
        """Pages no sequence holds (some of them cached)."""
        return len(self._free)

    @property
    def cached(self) -> int:
        """Pages that hold a cached prefix (held or free)."""
        return len(self._key_of)

    def take(self, count: int) -> list[int]:
        """``count`` free pages, held once each; the cached prefixes they held are dropped.

        Raises:
          pf.InvalidInputError: fewer than ``count`` pages are free.
        """
        if count > self.free:
            raise pf.InvalidInputError(f"count: expected at most {self.free} pages, got {count}")
        pages = []
        for _ in range(count):
            page, _ = self._free.popitem(last=False)
            key = self._key_of.pop(page, None)
            if key is not None:
                del self._page_of[key]
            self._holders[page] = 1
            pages.append(page)
        return pages

    def match(self, keys: Iterable[bytes]) -> list[int]:
        """The cached pages of the longest run of ``keys`` from the first, each held once
        more (a free one no longer free)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            self._hold(page)
            pages.append(page)
        return pages

    def _hold(self, page: int) -> None:
        if self._holders[page] == 0:
            del self._free[page]
        self._holders[page] += 1

    def cache(self, page: int, key: bytes) -> None:
        """Keys the full, held ``page`` by ``key`` for later prompts; a key already cached
        keeps its page (two sequences computed the same prefix at once)."""
        if not self.caching or key in self._page_of or page in self._key_of:
            return
        self._page_of[key], self._key_of[page] = page, key

    def release(self, pages: Sequence[int]) -> None:
        """Lets go of a sequence's ``pages`` (in its order): each freed page goes to the back
        of the queue, the sequence's last page first."""
        for page in reversed(pages):
            self._holders[page] -= 1
            if self._holders[page] == 0:
                self._free[page] = None
