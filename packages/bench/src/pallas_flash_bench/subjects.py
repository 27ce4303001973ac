"""What gets compiled: every installed backend, and jax's own Pallas attention kernels.

A :class:`Subject` turns a :class:`Workload` into a function of the workload's arrays (or
None when it cannot run it). jax's ``flash_attention`` and ``splash_attention`` are the
kernels a v5e user would otherwise pick; they go through the same analysis as our backends.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import math
import pathlib
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import pallas_flash as pf
from pallas_flash import hookspecs
from pallas_flash_bench.workloads import Workload


class ArraySpec(NamedTuple):
    """One argument: its shape, dtype and, for a call over several chips, the axis split
    over them (None: every chip holds all of it)."""

    shape: tuple[int, ...]
    dtype: str
    split_axis: int | None = None


def array_specs(workload: Workload) -> list[ArraySpec]:
    """The arguments: ``q, k, v`` or ``q, k_cache, v_cache, lengths`` (the caches split along
    their sequence axis when the call runs on several chips)."""
    w = workload
    if w.op == "decode":
        split = 2 if w.chips > 1 else None
        cache = ArraySpec((w.batch, w.kv_heads, w.seq_len, w.head_dim), w.dtype, split)
        return [
            ArraySpec((w.batch, w.q_heads, w.head_dim), w.dtype),
            cache,
            cache,
            ArraySpec((w.batch,), "int32"),
        ]
    kv = ArraySpec((w.batch, w.kv_heads, w.seq_len, w.head_dim), w.dtype)
    return [ArraySpec((w.batch, w.q_heads, w.seq_len, w.head_dim), w.dtype), kv, kv]


def _with_backward(forward: Callable[..., jax.Array]) -> Callable[..., tuple[jax.Array, ...]]:
    """Forward + backward: the gradients of ``sum(forward(q, k, v))`` w.r.t. q, k and v."""

    def loss(q, k, v):
        return forward(q, k, v).astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


@dataclasses.dataclass(frozen=True)
class Subject:
    """One implementation under test.

    Attributes:
      name: e.g. ``xla`` or ``jax-splash``.
      kind: ``backend`` (a Pallas-Flash backend) or ``reference`` (a jax kernel).
      config: block sizes or other settings, ``""`` for none.
      version: the providing distribution's version (part of the cache key).
      build: ``(workload, mesh) -> function of its arrays``, or None when unsupported;
        ``mesh``: the chips a multi-chip workload runs on (`aot.call_mesh`), None for one.
    """

    name: str
    kind: str
    config: str
    version: str
    build: Callable[[Workload, Mesh | None], Callable[..., object] | None]

    @property
    def id(self) -> str:
        return f"{self.name}[{self.config}]" if self.config else self.name


def _backend_build(
    info: pf.BackendInfo, workload: Workload, mesh: Mesh | None
) -> Callable[..., object] | None:
    needed = {"decode"} if workload.op == "decode" else {"attention"}
    if mesh is not None:
        needed.add("multi_device")
    if workload.op == "forward_backward":
        needed.add("grad")
    if workload.causal:
        needed.add("causal")
    if workload.q_heads != workload.kv_heads:
        needed.add("gqa")
    if not needed <= info.capabilities:
        return None
    if workload.op == "decode":
        return functools.partial(pf.decode, backend=info.name, mesh=mesh)
    forward = functools.partial(pf.attention, causal=workload.causal, backend=info.name)
    return forward if workload.op == "forward" else _with_backward(forward)


def _sources_digest(package: str) -> str:
    """A digest of the Python sources of an importable package (its directory's ``*.py``)."""
    spec = importlib.util.find_spec(package)
    digest = hashlib.sha256()
    for location in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(pathlib.Path(location).rglob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _backend_version(distribution: str | None) -> str:
    """The providing distribution's version and a digest of its sources and core's, so that
    cached rows of an edited (e.g. editable) install are recompiled."""
    if distribution is None:
        return ""
    dist = importlib.metadata.distribution(distribution)
    packages = sorted(
        {
            ep.module.split(".")[0]
            for ep in dist.entry_points
            if ep.group == hookspecs.ENTRY_POINT_GROUP
        }
    )
    digests = "-".join(_sources_digest(p) for p in ["pallas_flash", *packages])
    return f"{dist.version}+{digests}"


def backend_subjects(names: list[str] | None = None) -> list[Subject]:
    """The installed backends (or those named), as subjects."""
    infos = [i for i in pf.list_backends() if names is None or i.name in names]
    return [
        Subject(
            name=info.name,
            kind="backend",
            config="",
            version=_backend_version(info.distribution),
            build=functools.partial(_backend_build, info),
        )
        for info in infos
    ]


def _on_one_chip(
    build: Callable[[Workload], Callable[..., object] | None],
) -> Callable[[Workload, Mesh | None], Callable[..., object] | None]:
    """A jax kernel's build: it runs on one chip, so it supports no workload over a mesh."""

    def on_one_chip(workload: Workload, mesh: Mesh | None) -> Callable[..., object] | None:
        return build(workload) if mesh is None else None

    return on_one_chip


def _jax_flash_build(block: int | None, workload: Workload) -> Callable[..., object] | None:
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    if workload.op == "decode" or workload.q_heads != workload.kv_heads:
        return None
    sizes = None
    if block is not None:
        b = min(block, workload.seq_len)
        sizes = fa.BlockSizes(
            block_q=b, block_k_major=b, block_k=b, block_b=1,
            block_q_major_dkv=b, block_k_major_dkv=b, block_k_dkv=b, block_q_dkv=b,
            block_k_major_dq=b, block_k_dq=b, block_q_dq=b,
        )  # fmt: skip
    forward = functools.partial(
        fa.flash_attention,
        causal=workload.causal,
        sm_scale=1 / math.sqrt(workload.head_dim),
        block_sizes=sizes,
    )
    return forward if workload.op == "forward" else _with_backward(forward)


def _splash_build(blocks: tuple[int, int], workload: Workload) -> Callable[..., object] | None:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if workload.op == "decode" or workload.q_heads != workload.kv_heads:
        return None
    n = workload.seq_len
    bq, bkv = (min(b, n) for b in blocks)
    head_mask = sm.CausalMask((n, n)) if workload.causal else sm.FullMask((n, n))
    kernel = sk.make_splash_mha(
        sm.MultiHeadMask([head_mask] * workload.q_heads),
        head_shards=1,
        q_seq_shards=1,
        block_sizes=sk.BlockSizes(
            block_q=bq,
            block_kv=bkv,
            block_kv_compute=bkv,
            block_q_dkv=bq,
            block_kv_dkv=bkv,
            block_kv_dkv_compute=bkv,
            block_q_dq=bq,
            block_kv_dq=bkv,
        ),
    )
    scale = 1 / math.sqrt(workload.head_dim)

    def forward(q, k, v):  # splash takes [heads, seq, head_dim] and applies no scale
        return jax.vmap(kernel)(q * jnp.asarray(scale, q.dtype), k, v)

    return forward if workload.op == "forward" else _with_backward(forward)


PAGE_SIZE = 128
"""Cache positions per page of jax's ``paged_attention``."""


def _paged_build(pages_per_block: int, workload: Workload) -> Callable[..., object] | None:
    """jax's ``paged_attention`` on the workload's cache, for batch 1 only: there the
    contiguous ``[1, kv_heads, max_len, head_dim]`` cache is, by a free reshape, the pages
    ``[kv_heads, max_len / 128, 128, head_dim]`` of one sequence in order.

    Its blocks of pages run as grid steps (``inline_seq_dim=False``). jax's default runs them
    in a loop inside each step whose trip count reads ``lengths``: a static schedule counts
    that loop's body once, so its cycles would cover one block of the sequence, not all."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    w = workload
    if w.op != "decode" or w.batch != 1 or w.seq_len % (PAGE_SIZE * pages_per_block):
        return None
    pages = w.seq_len // PAGE_SIZE
    scale = 1 / math.sqrt(w.head_dim)

    def decode(q, k_cache, v_cache, lengths):  # paged_attention applies no scale
        shape = (w.kv_heads, pages, PAGE_SIZE, w.head_dim)
        page_indices = jnp.arange(pages, dtype=jnp.int32)[None]
        return paged_attention(
            q * jnp.asarray(scale, q.dtype),
            k_cache.reshape(shape),
            v_cache.reshape(shape),
            lengths,
            page_indices,
            pages_per_compute_block=pages_per_block,
            inline_seq_dim=False,
        )

    return decode


PAGED_BLOCKS = {"quick": [16], "default": [8, 16]}
"""jax ``paged_attention`` pages per compute block to try (of 128 positions each)."""
FLASH_BLOCKS = {"quick": [None, 512], "default": [None, 512, 1024]}
"""jax ``flash_attention`` block sizes to try (None: its default, 128)."""
SPLASH_BLOCKS = {
    "quick": [(512, 1024), (1024, 1024)],
    "default": [(512, 512), (512, 1024), (1024, 1024), (2048, 1024)],
}
"""jax ``splash_attention`` (block_q, block_kv) sizes to try: in the default sweep, 1024/1024
is the fastest forward and 512/1024 the fastest causal forward+backward; 2048/2048 does not
compile (its VMEM scratch overflows the default scoped limit)."""


def reference_subjects(sweep: str) -> list[Subject]:
    """jax's flash_attention (default and larger blocks), splash_attention and, for decode,
    paged_attention."""
    version = jax.__version__
    flash = [
        Subject(
            name="jax-flash",
            kind="reference",
            config=f"blocks {block}" if block else "default blocks",
            version=version,
            build=_on_one_chip(functools.partial(_jax_flash_build, block)),
        )
        for block in FLASH_BLOCKS[sweep]
    ]
    splash = [
        Subject(
            name="jax-splash",
            kind="reference",
            config=f"blocks {bq}/{bkv}",
            version=version,
            build=_on_one_chip(functools.partial(_splash_build, (bq, bkv))),
        )
        for bq, bkv in SPLASH_BLOCKS[sweep]
    ]
    paged = [
        Subject(
            name="jax-paged",
            kind="reference",
            config=f"grid of {pages}-page blocks",
            version=version,
            build=_on_one_chip(functools.partial(_paged_build, pages)),
        )
        for pages in PAGED_BLOCKS[sweep]
    ]
    return flash + splash + paged


def all_subjects(sweep: str, backends: list[str] | None, references: bool) -> dict[str, Subject]:
    """Subjects by id, in report order: backends first."""
    subjects = backend_subjects(backends) + (reference_subjects(sweep) if references else [])
    return {s.id: s for s in subjects}
