"""What gets compiled: every installed backend and, from `references`, the kernels a v5e user
would otherwise pick.

A :class:`Subject` turns a :class:`Workload` into a function of the workload's arrays (or
None when it cannot run it); every subject goes through the same analysis.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import pallas_flash as pf
from pallas_flash import hookspecs
from pallas_flash_bench.kernels import backend_kernels, ragged_step
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.aot.program_ref import ArraySpec


def array_specs(workload: Workload) -> list[ArraySpec]:
    """The arguments: ``q, k, v`` (and the ``bias``) or ``q, k_cache, v_cache, lengths`` (the
    caches split along
    their sequence axis, a paged pool along its pages, when the call runs on several chips),
    then for a paged cache its ``page_table`` and for an int8 one its ``k_scales, v_scales``
    (`decode_options`); or a ragged step's (`ragged_specs`)."""
    w = workload
    if w.op == "ragged":
        return ragged_specs(w)
    if w.op == "decode":
        split = (0 if w.cache == "paged" else 2) if w.chips > 1 else None
        if w.cache == "paged":
            blocks = (w.num_pages, w.kv_heads, w.page_size)
        else:
            blocks = (w.batch, w.kv_heads, w.seq_len)
        cache = ArraySpec((*blocks, w.head_dim), w.cache_dtype or w.dtype, split)
        specs = [
            ArraySpec((w.batch, w.q_heads, w.head_dim), w.dtype),
            cache,
            cache,
            ArraySpec((w.batch,), "int32"),
        ]
        if w.cache == "paged":
            specs.append(ArraySpec((w.batch, w.seq_len // w.page_size), "int32"))
        if w.cache_dtype == "int8":
            specs += [ArraySpec(blocks, "float32", split)] * 2
        return specs
    k = ArraySpec((w.batch, w.kv_heads, w.seq_len, w.head_dim), w.dtype)
    v = ArraySpec((w.batch, w.kv_heads, w.seq_len, w.value_head_dim), w.dtype)
    specs = [ArraySpec((w.batch, w.q_heads, w.seq_len, w.head_dim), w.dtype), k, v]
    if w.bias:
        specs.append(ArraySpec((1, w.q_heads, w.seq_len, w.seq_len), w.dtype))
    return specs


def ragged_specs(workload: Workload) -> list[ArraySpec]:
    """``pf.ragged_attention``'s arguments: ``q [tokens, q_heads, head_dim]``, ``k, v [tokens,
    kv_heads, head_dim]``, the cache's pools ``[num_pages, kv_heads, page_size, head_dim]``
    (`ragged_cache`: k's and v's, or the packed one, `ragged_step.packed`), ``page_table
    [seqs, seq_len / page_size]``, ``query_starts [seqs + 1]`` and ``kv_lengths [seqs]``."""
    w = workload
    seqs, new = len(w.sequence_lengths), ArraySpec((w.tokens, w.kv_heads, w.head_dim), w.dtype)
    shape = (w.num_pages, w.kv_heads, w.page_size, w.head_dim)
    packed = ragged_step.packed(w)
    pools = [ArraySpec(shape, "uint32")] if packed else [ArraySpec(shape, w.dtype)] * 2
    return [
        ArraySpec((w.tokens, w.q_heads, w.head_dim), w.dtype),
        new,
        new,
        *pools,
        ArraySpec((seqs, w.seq_len // w.page_size), "int32"),
        ArraySpec((seqs + 1,), "int32"),
        ArraySpec((seqs,), "int32"),
    ]


def ragged_cache(workload: Workload) -> tuple[int, ...]:
    """The cache's pools in `ragged_specs` (k's and v's, or the packed one): donated, as a
    serving engine donates them, so that the write of the new tokens is in place."""
    return (3,) if ragged_step.packed(workload) else (3, 4)


def no_donation(workload: Workload) -> tuple[int, ...]:
    """Nothing donated."""
    return ()


def backend_donation(workload: Workload) -> tuple[int, ...]:
    """A backend's donated arguments: a ragged step's cache (`ragged_cache`), nothing else."""
    return ragged_cache(workload) if workload.op == "ragged" else ()


def decode_options(workload: Workload, extra: tuple[jax.Array, ...]) -> dict[str, jax.Array]:
    """``pf.decode``'s keyword arguments from the arrays after ``lengths`` (`array_specs`)."""
    names = (["page_table"] if workload.cache == "paged" else []) + (
        ["k_scales", "v_scales"] if workload.cache_dtype == "int8" else []
    )
    return dict(zip(names, extra, strict=True))


def with_backward(forward: Callable[..., jax.Array]) -> Callable[..., tuple[jax.Array, ...]]:
    """Forward + backward: the gradients of ``sum(forward(q, k, v, *constants))`` w.r.t. q, k
    and v (a bias is a constant)."""

    def loss(q, k, v, *constants):
        return forward(q, k, v, *constants).astype(jnp.float32).sum()

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
      whole_vmem: its programs are compiled with the target core's whole VMEM as the
        scoped-VMEM limit (`aot.whole_vmem_options`), for kernels that set no limit of their
        own; the version must say so, as it keys the cache.
      arguments: the shapes of the arrays ``build``'s function takes (default `array_specs`,
        the layouts of ``pf.attention`` and ``pf.decode``); a reference whose kernel reads
        another layout takes its own, so that no copy into ours is charged to it.
      loop_trips: ``(workload, kernel name) -> runs``: for a Pallas kernel whose loops read
        their trip counts from memory, how often each of those loops runs over the whole
        kernel on the workload, in program order (outermost first)
        (`pallas_flash_estimate.evaluate.loop_trips`); None for a kernel it does not know.
        Without it such loops count once.
      min_hbm_bytes: the least the subject must move on a workload (default
        `Workload.min_hbm_bytes`), for a reference that reads less (no int8 scale arrays).
      notes: ``workload -> notes`` for its rows (what its figures rest on).
      donate: ``workload -> the arguments (indices)`` its program may overwrite, donated as
        their owner would donate them: a kernel that updates a cache in place (an input
        aliased to an output) otherwise makes XLA copy the whole cache first.
    """

    name: str
    kind: str
    config: str
    version: str
    build: Callable[[Workload, Mesh | None], Callable[..., object] | None]
    whole_vmem: bool = False
    arguments: Callable[[Workload], list[ArraySpec]] = array_specs
    loop_trips: Callable[[Workload, str], tuple[int, ...] | None] | None = None
    min_hbm_bytes: Callable[[Workload], float] | None = None
    notes: Callable[[Workload], list[str]] | None = None
    donate: Callable[[Workload], tuple[int, ...]] = no_donation

    @property
    def id(self) -> str:
        return f"{self.name}[{self.config}]" if self.config else self.name


def _backend_build(
    info: pf.BackendInfo, workload: Workload, mesh: Mesh | None
) -> Callable[..., object] | None:
    needed = {"attention"} if workload.op in ("forward", "forward_backward") else {workload.op}
    if mesh is not None:
        needed.add("multi_device")
    if workload.op == "forward_backward":
        needed.add("grad")
    if workload.causal:
        needed.add("causal")
    if workload.q_heads != workload.kv_heads:
        needed.add("gqa")
    if workload.value_head_dim != workload.head_dim:
        needed.add("value_head_dim")
    if workload.bias:
        needed.add("bias")
    if workload.cache == "paged" and workload.op == "decode":
        needed.add("paged_cache")
    if workload.cache_dtype == "int8":
        needed.add("int8_cache")
    if workload.op == "ragged" and ragged_step.packed(workload):
        needed.add("packed_cache")
    if workload.sliding_window is not None:
        needed.add("sliding_window")
    if not needed <= info.capabilities:
        return None
    if workload.op == "ragged":
        window = ragged_step.pf_window(workload)

        def ragged(q, k, v, *pools_and_layout):
            pools, layout = pools_and_layout[:-3], pools_and_layout[-3:]
            return pf.ragged_attention(
                q, k, v, pools[0], pools[1] if len(pools) == 2 else None, *layout,
                sliding_window=window, backend=info.name,
            )  # fmt: skip

        return ragged
    if workload.op == "decode":

        def decode(q, k_cache, v_cache, lengths, *extra):
            options = decode_options(workload, extra)
            return pf.decode(q, k_cache, v_cache, lengths, backend=info.name, mesh=mesh, **options)

        return decode

    def forward(q, k, v, *bias):
        return pf.attention(q, k, v, causal=workload.causal, bias=next(iter(bias), None),
                            backend=info.name)  # fmt: skip

    return forward if workload.op == "forward" else with_backward(forward)


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


def program_code_versions() -> dict[str, str]:
    """What a whole program built from our packages (a model or context job) depends on beside
    the analysis: every installed backend's version with its sources' digest
    (`_backend_version`), and the LLaMa package's when installed. In the job's cache key, so
    that an edited kernel or model recompiles it."""
    versions = {info.name: _backend_version(info.distribution) for info in pf.list_backends()}
    if importlib.util.find_spec("pallas_flash_llama") is not None:
        llama = importlib.metadata.version("pallas-flash-llama")
        versions["llama"] = f"{llama}+{_sources_digest('pallas_flash_llama')}"
    return versions


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
            loop_trips=functools.partial(backend_kernels.loop_trips, info.name),
            min_hbm_bytes=functools.partial(backend_kernels.min_hbm_bytes, info.name),
            donate=backend_donation,
        )
        for info in infos
    ]
