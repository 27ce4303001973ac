"""What a static schedule cannot read off our own kernels on a mixed serving step (op
``ragged``), given here from the kernels' own modules on the arrays the bench compiles the step
for (`ragged_step`), as the references' modules give theirs (`rpa_reference.loop_trips`).

- Loop trips (a backend subject's ``Subject.loop_trips``): loops whose trip counts are read
  from memory, which a static schedule counts once per grid step, a lower bound. Core's write
  of the new tokens into their pages (`pallas_flash.page_write_kernel`, keys and values in one
  call) runs a loop over groups of items and, in it, three loops over the group's items, then
  the same loops over the pages it writes whole;
  splitkv's ragged attention (`pallas_flash_splitkv.ragged_attention`: a call for the decoding
  sequences, one for the others) a loop over its used work items and, inside it, two loops
  over each item's kv blocks (those folded whole, the masked).
- HBM bytes (``Subject.min_hbm_bytes``): the page write moves whole chunks of the pool (the
  rows beside a decode token's, read and written back), more than the least a step must move
  (`ragged_step.min_hbm_bytes`), whose copy trap sees only XLA's ops; splitkv's ragged calls
  on a packed pool write the new tokens themselves, copying each position they read once
  (`pallas_flash_splitkv.ragged_copies`): the least.
- In a whole program (a model's step, `occupancy`): each kernel's loop trips, and for
  splitkv's ragged calls the share of the pool they read, the pages of their own sequences.

A step may be padded to more tokens than its sequences hold (the engine's token bucket):
``tokens`` gives the padded count the kernels were compiled for.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_flash as pf
from pallas_flash import page_write_kernel, page_write_plan
from pallas_flash.kv_packing import PACKED_DTYPE
from pallas_flash.ragged_write import token_pages
from pallas_flash_bench.kernels import ragged_step
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.cost import kernel_cost


def loop_trips(
    backend: str,
    workload: Workload,
    kernel: str,
    tokens: int | None = None,
    cache_dtype: str | None = None,
) -> tuple[int, ...] | None:
    """The runs of ``kernel``'s loops without a trip count over the whole kernel, in program
    order, when ``backend`` runs ``workload`` (padded to ``tokens``, default its own; its
    cache in ``cache_dtype``: None for the workload's, packed where 16-bit, or ``"int8"``);
    None for a kernel without such loops here."""
    if workload.op != "ragged":
        return None
    stem = kernel.split(".")[0]
    tokens = workload.tokens if tokens is None else tokens
    if stem == page_write_kernel.KERNEL_NAME:
        return _page_write_runs(workload, tokens, cache_dtype)
    ragged = _splitkv_ragged(backend)
    if ragged is not None and stem in (ragged.KERNEL_NAME, ragged.DECODE_KERNEL_NAME):
        return _ragged_runs(ragged, workload, stem, tokens)
    return None


def occupancy(
    backend: str, workload: Workload, tokens: int | None = None, cache_dtype: str | None = None
) -> Callable[[str], kernel_cost.FullGrid]:
    """For a whole program that runs ``workload`` (a ragged step, padded to ``tokens``, its
    cache in ``cache_dtype`` as `loop_trips` takes it) on one chip: each Pallas kernel's
    occupancy by name, its `loop_trips` and, for splitkv's
    ragged calls, the share of its operands it reads: the pool's pages its own sequences
    hold (the pools are nearly all of its operands' bytes)."""
    tokens = workload.tokens if tokens is None else tokens
    shares = _pool_shares(backend, workload, tokens)

    @functools.cache
    def of(kernel: str) -> kernel_cost.FullGrid:
        trips = loop_trips(backend, workload, kernel, tokens, cache_dtype)
        return kernel_cost.FullGrid(loop_trips=trips, copied=shares.get(kernel.split(".")[0]))

    return of


def _splitkv_ragged(backend: str):
    """splitkv's ``ragged_attention`` module where ``backend`` is splitkv and installed."""
    if backend != "splitkv" or importlib.util.find_spec("pallas_flash_splitkv") is None:
        return None
    from pallas_flash_splitkv import ragged_attention

    return ragged_attention


def _pool_shares(backend: str, w: Workload, tokens: int) -> dict[str, float]:
    """Per ragged call of splitkv (`ragged_blocks.kernel_calls`), by kernel name: the pages
    its sequences hold over the pool's."""
    if _splitkv_ragged(backend) is None or w.op != "ragged":
        return {}
    from pallas_flash_splitkv import ragged_blocks

    starts, lengths = _arrays(w)
    pages = np.ceil(np.asarray(lengths) / w.page_size)
    shares = {}
    queries = jax.ShapeDtypeStruct((tokens, w.q_heads, w.head_dim), w.dtype)
    for call in ragged_blocks.kernel_calls(starts, queries, w.kv_heads, _blocks()):
        taken = np.ones(len(pages), bool) if call.include is None else np.asarray(call.include)
        shares[call.name] = float(pages[taken].sum()) / w.num_pages
    return shares


def min_hbm_bytes(backend: str, workload: Workload) -> float:
    """The least ``backend`` moves on ``workload``: on a serving step, the workload's least
    with the page write's chunks and whole pages (`page_write_kernel.moved_bytes`, K and V, or
    a packed pool's) in place of the new rows written into their pages, which the least
    counts; the least itself where the backend's kernels write the new tokens (`writes_own`)."""
    w = workload
    if w.op != "ragged" or writes_own(backend, w):
        return w.min_hbm_bytes
    moved = _pools(w) * page_write_kernel.moved_bytes(_page_write_plan(w), _pool(w))
    new_rows = ragged_step.tokens(w) * w.cache_bytes_per_token
    return w.min_hbm_bytes + moved - new_rows


def writes_own(backend: str, w: Workload) -> bool:
    """Whether ``backend``'s kernels write a serving step's new tokens themselves, with no
    page write of core's: splitkv's on a packed pool
    (``SplitKvBackend.ragged_attention_and_write``)."""
    return _splitkv_ragged(backend) is not None and ragged_step.packed(w)


def _pool(w: Workload, cache_dtype: str | None = None) -> jax.ShapeDtypeStruct:
    """One pool of the step's cache: K's (or V's), int8 where ``cache_dtype`` says so, or the
    packed pool of both (`ragged_step.packed`)."""
    dtype = cache_dtype or (PACKED_DTYPE if ragged_step.packed(w) else w.dtype)
    return jax.ShapeDtypeStruct((w.num_pages, w.kv_heads, w.page_size, w.head_dim), dtype)


def _pools(w: Workload, cache_dtype: str | None = None) -> int:
    """The cache's pools: K and V, or the packed one."""
    return 1 if cache_dtype is None and ragged_step.packed(w) else 2


def _arrays(w: Workload) -> tuple[jax.Array, jax.Array]:
    """``query_starts``, ``kv_lengths`` of the step."""
    starts = jnp.asarray(ragged_step.query_starts(w), jnp.int32)
    return starts, jnp.asarray(ragged_step.kv_lengths(w), jnp.int32)


def _page_write_plan(w: Workload) -> tuple[page_write_plan.Items, page_write_plan.WholePages]:
    """The page write's chunk items and whole pages on the step (the same for K and V)."""
    return page_write_kernel.plan(_pool(w), *_token_pages(w, w.tokens), _sequences(w),
                                  pools=_pools(w))  # fmt: skip


def _page_write_runs(w: Workload, tokens: int, cache_dtype: str | None) -> tuple[int, ...]:
    """The page write's loops on the step padded to ``tokens`` (`page_write_kernel.loop_runs`,
    keys and values in one call, or the packed pool)."""
    pool = _pool(w, cache_dtype)
    return page_write_kernel.loop_runs(pool, *_token_pages(w, tokens), _sequences(w),
                                       pools=_pools(w, cache_dtype))  # fmt: skip


def _token_pages(w: Workload, tokens: int) -> tuple[jax.Array, jax.Array]:
    """Each new token's page and row on the step padded to ``tokens``."""
    starts, lengths = _arrays(w)
    table = jnp.asarray(ragged_step.page_table(w))
    return token_pages(table, w.page_size, starts, lengths, tokens)


def _sequences(w: Workload) -> int:
    """The step's sequences."""
    return len(ragged_step.kv_lengths(w))


def _blocks():
    """The ragged blocks the registered splitkv backend uses."""
    return pf.get_backend("splitkv").ragged_blocks


def _ragged_runs(ragged, w: Workload, kernel: str, tokens: int) -> tuple[int, ...]:
    """`ragged_attention.loop_runs` of the call named ``kernel`` on ``tokens`` rows."""
    starts, lengths = _arrays(w)
    spec = pf.RaggedSpec(sm_scale=w.head_dim**-0.5, window=ragged_step.pf_window(w))
    return ragged.loop_runs(
        starts, lengths, kernel=kernel, tokens=tokens, q_heads=w.q_heads, kv_heads=w.kv_heads,
        head_dim=w.head_dim, dtype=w.dtype, page_size=w.page_size,
        pages_per_sequence=w.seq_len // w.page_size, spec=spec, blocks=_blocks(),
    )  # fmt: skip
