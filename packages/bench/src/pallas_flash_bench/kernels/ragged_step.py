"""One step of a serving engine as ``pf.ragged_attention`` runs it: a flat batch of new
tokens from many sequences, decode tokens and prefill chunks mixed, against their paged cache.

A step (a `Workload` of op ``ragged``) holds ``batch`` decoding sequences, one new token each,
whose cached lengths are drawn as a serving decode batch's (`Workload.sequence_lengths`),
then ``prefill = (chunks, chunk)`` sequences being prefilled, ``chunk`` new tokens each after
``prefill_context`` tokens already cached. Decoding sequences come first, as RPA v3's
``distribution`` wants them (``[0:i]`` decode, ``[i:k]`` mixed); every subject gets the same
order. ``kv_lengths`` count the new tokens, as ``pf.ragged_attention``'s do. A windowed
layer's step (``sliding_window = W``) lets each new token see the ``W`` positions up to its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pallas_flash import kv_packing

if TYPE_CHECKING:
    from pallas_flash_bench.kernels.workloads import Workload


def query_lengths(workload: Workload) -> np.ndarray:
    """``[seqs]``: new tokens per sequence, decodes (1 each) then chunks."""
    chunks, chunk = workload.prefill or (0, 0)
    return np.array([1] * workload.batch + [chunk] * chunks, np.int64)


def kv_lengths(workload: Workload) -> np.ndarray:
    """``[seqs]``: each sequence's positions once its new tokens are cached."""
    chunks, chunk = workload.prefill or (0, 0)
    decoding = workload.drawn_lengths()
    return np.concatenate([decoding, np.full(chunks, workload.prefill_context + chunk, np.int64)])


def query_starts(workload: Workload) -> np.ndarray:
    """``[seqs + 1]``: ``pf.ragged_attention``'s ``query_starts`` (RPA's ``cu_q_lens``)."""
    return np.concatenate([[0], np.cumsum(query_lengths(workload))]).astype(np.int64)


def tokens(workload: Workload) -> int:
    """New tokens of the step (no padding): the step's token budget."""
    return int(query_lengths(workload).sum())


def pf_window(workload: Workload) -> int | None:
    """``pf.ragged_attention``'s ``sliding_window`` for the step: a token at ``p`` sees ``p - w``
    to ``p``, so one less than the positions the workload's window counts."""
    return None if workload.sliding_window is None else workload.sliding_window - 1


def packed(workload: Workload) -> bool:
    """Whether the step's cache is packed, as the serving engine keeps a 16-bit one: keys and
    values in one uint32 pool (`pallas_flash.kv_packing`)."""
    return kv_packing.packable(workload.dtype)


def visible_pairs(workload: Workload) -> int:
    """(query, key) pairs the causal mask (and window) lets through: a new token at position
    ``p`` sees ``p + 1`` positions, at most ``sliding_window``."""
    window = workload.sliding_window
    total = 0
    for n, length in zip(query_lengths(workload), kv_lengths(workload), strict=True):
        seen = np.arange(length - n + 1, length + 1, dtype=np.int64)
        total += int((seen if window is None else np.minimum(seen, window)).sum())
    return total


def useful_flops(workload: Workload) -> float:
    """``q k^T`` and ``p v`` over the visible pairs: ``4 q_heads head_dim`` each."""
    w = workload
    return 4.0 * w.q_heads * w.head_dim * visible_pairs(w)


def min_hbm_bytes(workload: Workload) -> float:
    """The least a step moves: its queries read and outputs written, the new keys and values
    read and written into their pages, and every cached position a new token sees read once
    (with a window of ``W``, the ``W - 1`` before the first new token at most)."""
    w = workload
    new = tokens(w)
    q_sized = new * w.q_heads * w.head_dim * w.itemsize
    before = kv_lengths(w) - query_lengths(w)
    if w.sliding_window is not None:
        before = np.minimum(before, w.sliding_window - 1)
    cached = float(before.sum())
    return 2 * q_sized + w.cache_bytes_per_token * (2 * new + cached)


def label(workload: Workload) -> str:
    """E.g. ``ragged T=512 H32/8 prefill 1x448 after 1024 + decode 64 lengths 512..8192
    paged/128``, then `` window 4096`` for a windowed layer's step."""
    w = workload
    heads = "" if w.q_heads == 16 == w.kv_heads else f" H{w.q_heads}/{w.kv_heads}"
    parts = []
    if w.prefill:
        after = f" after {w.prefill_context}" if w.prefill_context else ""
        parts.append(f"prefill {w.prefill[0]}x{w.prefill[1]}{after}")
    if w.batch:
        spread = " evenly" if w.even_lengths else ""
        lengths = f" lengths {w.lengths[0]}..{w.lengths[1]}{spread}" if w.lengths else ""
        parts.append(f"decode {w.batch}{lengths}")
    window = f" window {w.sliding_window}" if w.sliding_window is not None else ""
    return f"ragged T={tokens(w)}{heads} {' + '.join(parts)} paged/{w.page_size}{window}"


def page_table(workload: Workload, rng: np.random.Generator | None = None) -> np.ndarray:
    """``[seqs, seq_len / page_size]``: each sequence its own pages of the pool, in order or,
    given ``rng``, shuffled; unused columns page 0."""
    w = workload
    lengths = kv_lengths(w)
    pages = np.arange(w.num_pages) if rng is None else rng.permutation(w.num_pages)
    table = np.zeros((len(lengths), w.seq_len // w.page_size), np.int32)
    taken = 0
    for s, n in enumerate(lengths):
        used = -(-int(n) // w.page_size)
        table[s, :used] = pages[taken : taken + used]
        taken += used
    return table
