"""The reference kernels a v5e user would otherwise pick, each in the configurations of a sweep:
jax's ``flash_attention``, ``splash_attention`` (with its fused backward too) and, for decode,
``paged_attention`` and ``ragged_paged_attention``; tokamax's splash attention where tokamax is
installed, and tpu-inference's Ragged Paged Attention v3 (vLLM's decode kernel on TPU) where
tpu-inference is.

Every reference program is compiled with the scoped-VMEM limit our kernels may request, so
that no reference loses a configuration to a smaller VMEM budget than ours.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import math
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pallas_flash_bench.kernels import (
    paged_reference,
    ragged_reference,
    rpa_mixed,
    rpa_reference,
)
from pallas_flash_bench.kernels.subjects import (
    Subject,
    array_specs,
    backend_subjects,
    with_backward,
)
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.aot.program_ref import ArraySpec

Config = TypeVar("Config")


def _on_one_chip(
    build: Callable[[Workload], Callable[..., object] | None],
) -> Callable[[Workload, Mesh | None], Callable[..., object] | None]:
    """A reference's build: it runs on one chip, so it supports no workload over a mesh."""

    def on_one_chip(workload: Workload, mesh: Mesh | None) -> Callable[..., object] | None:
        return build(workload) if mesh is None else None

    return on_one_chip


def _attention(
    workload: Workload, blocks: tuple[int, ...] = (), *, bias: bool = False, grouped: bool = False
) -> bool:
    """Whether a reference attention kernel takes the workload: attention (not decode nor a
    ragged step), with
    as many kv heads as query heads unless the kernel takes groups (``grouped``: splash),
    v's head_dim q's and a multiple of 64 (jax's kernels compile 64 and multiples of 128 for
    v5e; MLA's 192/128 they do not take), a sequence every block divides (as splash
    requires; a longer block, clamped, would repeat a configuration of shorter ones); with a
    bias only if the kernel takes one (``bias``: jax ``flash_attention``'s ``ab``, whose batch
    axis is the inputs', so batch 1 only: the workload's bias is shared by the batch)."""
    w = workload
    same_dims = w.v_head_dim is None and w.head_dim % 64 == 0
    return (
        w.op in ("forward", "forward_backward")
        and (grouped or w.q_heads == w.kv_heads)
        and same_dims
        and all(w.seq_len % b == 0 for b in blocks)
        and (not w.bias or (bias and w.batch == 1))
    )


class FlashBlocks(NamedTuple):
    """jax ``flash_attention``'s query block, key block and key sub-block, in the forward
    and both backward kernels."""

    q: int
    k_major: int
    k: int

    @property
    def label(self) -> str:
        blocks = f"{self.q}" if self.q == self.k_major else f"{self.q}/{self.k_major}"
        return f"blocks {blocks}{f', k compute {self.k}' if self.k != self.k_major else ''}"


def _jax_flash_build(
    blocks: FlashBlocks | None, workload: Workload
) -> Callable[..., object] | None:
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    if not _attention(workload, blocks or (), bias=True):
        return None
    sizes = None
    if blocks is not None:
        q, km, k = blocks
        sizes = fa.BlockSizes(
            block_q=q, block_k_major=km, block_k=k, block_b=1,
            block_q_major_dkv=q, block_k_major_dkv=km, block_k_dkv=k, block_q_dkv=q,
            block_k_major_dq=km, block_k_dq=k, block_q_dq=q,
        )  # fmt: skip
    forward = functools.partial(
        fa.flash_attention,
        causal=workload.causal,
        sm_scale=1 / math.sqrt(workload.head_dim),
        block_sizes=sizes,
    )
    return forward if workload.op == "forward" else with_backward(forward)


class SplashBlocks(NamedTuple):
    """Splash attention's query block, kv block and kv sub-block (forward and backward), and
    whether the backward is its fused kernel (dq with dk/dv: forward+backward only)."""

    q: int
    kv: int
    kv_compute: int
    fused: bool = False

    @property
    def label(self) -> str:
        compute = f", kv compute {self.kv_compute}" if self.kv_compute != self.kv else ""
        return f"blocks {self.q}/{self.kv}{compute}{', fused backward' if self.fused else ''}"


def _splash_sizes(sk, blocks: SplashBlocks):
    """Splash's ``BlockSizes``; the fused backward takes no dq blocks."""
    dq = {} if blocks.fused else {"block_q_dq": blocks.q, "block_kv_dq": blocks.kv}
    return sk.BlockSizes(
        block_q=blocks.q, block_kv=blocks.kv, block_kv_compute=blocks.kv_compute,
        block_q_dkv=blocks.q, block_kv_dkv=blocks.kv, block_kv_dkv_compute=blocks.kv_compute,
        use_fused_bwd_kernel=blocks.fused, **dq,
    )  # fmt: skip


def _splash_build(blocks: SplashBlocks, workload: Workload) -> Callable[..., object] | None:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    w = workload
    if not _attention(w, blocks[:3], grouped=True) or (blocks.fused and w.op != "forward_backward"):
        return None
    n = w.seq_len
    head_mask = sm.CausalMask((n, n)) if w.causal else sm.FullMask((n, n))
    kernel = sk.make_splash_mha(
        sm.MultiHeadMask([head_mask] * w.q_heads),
        head_shards=1,
        q_seq_shards=1,
        block_sizes=_splash_sizes(sk, blocks),
    )
    scale = 1 / math.sqrt(w.head_dim)

    def forward(q, k, v):  # splash takes [heads, seq, head_dim] and applies no scale
        return jax.vmap(kernel)(q * jnp.asarray(scale, q.dtype), k, v)

    return forward if w.op == "forward" else with_backward(forward)


def _tokamax_implementation(blocks: SplashBlocks):
    """tokamax's Mosaic TPU attention with the given blocks in its forward and (fused)
    backward, its other settings those of its heuristic."""
    from tokamax._src.ops.attention import pallas_mosaic_tpu as tpu
    from tokamax._src.ops.attention import pallas_mosaic_tpu_vjp as tpu_vjp

    layout = tpu.splash.QKVLayout.HEAD_DIM_MINOR
    return tpu.PallasMosaicTpuFlashAttention(
        config=tpu.Config(
            block_q=blocks.q, block_kv=blocks.kv, block_kv_compute=blocks.kv_compute,
            q_layout=layout, k_layout=layout, v_layout=layout, use_experimental_scheduler=True,
        ),
        vjp=tpu_vjp.PallasMosaicTpuFlashAttentionVjp(
            config=tpu_vjp.Config(block_q_dkv=blocks.q, block_kv_dkv=blocks.kv,
                                  block_kv_dkv_compute=blocks.kv_compute),
        ),
    )  # fmt: skip


def _tokamax_build(blocks: SplashBlocks | None, workload: Workload) -> Callable[..., object] | None:
    """``tokamax.dot_product_attention`` (``implementation="mosaic"``) with its own block
    choice (None: on v5e, where it has no tuned configurations, its heuristic 128/128) or the
    given blocks. It takes ``[batch, seq, heads, head_dim]``: the swaps around it cancel
    its own. It checks the default device, which `aot.compile_for` sets to the target's."""
    import tokamax
    from absl import flags

    if not _attention(workload, blocks[:3] if blocks else ()):
        return None
    if not flags.FLAGS.is_parsed():  # else tokamax parses this process's argv as its flags
        flags.FLAGS.mark_as_parsed()
    implementation = "mosaic" if blocks is None else _tokamax_implementation(blocks)

    def forward(q, k, v):
        swapped = (x.swapaxes(1, 2) for x in (q, k, v))
        out = tokamax.dot_product_attention(
            *swapped,
            scale=1 / math.sqrt(workload.head_dim),
            is_causal=workload.causal,
            implementation=(implementation,),
        )
        return out.swapaxes(1, 2)

    return forward if workload.op == "forward" else with_backward(forward)


FLASH_BLOCKS: dict[str, list[FlashBlocks | None]] = {
    "quick": [
        FlashBlocks(512, 512, 512),
        FlashBlocks(1024, 1024, 1024),
        FlashBlocks(4096, 1024, 1024),
    ],
    "default": [
        None,
        FlashBlocks(512, 512, 512),
        FlashBlocks(1024, 1024, 1024),
        FlashBlocks(1024, 1024, 512),
        FlashBlocks(2048, 1024, 1024),
        FlashBlocks(2048, 2048, 1024),
        FlashBlocks(4096, 1024, 1024),
        FlashBlocks(1280, 1280, 1280),
        FlashBlocks(1536, 1536, 1536),
    ],
}
"""jax ``flash_attention`` blocks to try (None: its default, 128). At N=8192 (static
estimate) 1024 is its fastest causal forward and forward+backward, 4096/1024 and 2048/1024
its fastest forward without a mask. 1280 and 1536 are for `sweeps.OTHER_LENGTHS`: at
N=1536 no power of two above 512 divides the sequence, and 1280 (5120) and 1536 (3072, 6144,
12288, 24576) are the blocks a user would try there beside the powers of two. Quick: the
fastest of each kind of workload (1024; 4096/1024 without a mask), and 512 for short
sequences."""
SPLASH_BLOCKS = {
    "quick": [
        SplashBlocks(1024, 1024, 1024),
        SplashBlocks(2048, 2048, 2048),
        SplashBlocks(1024, 1024, 512, fused=True),
    ],
    "default": [
        SplashBlocks(512, 1024, 1024),
        SplashBlocks(1024, 1024, 1024),
        SplashBlocks(1024, 1024, 512),
        SplashBlocks(1024, 1024, 256),
        SplashBlocks(2048, 2048, 1024),
        SplashBlocks(2048, 2048, 2048),
        SplashBlocks(4096, 1024, 1024),
        SplashBlocks(1280, 1280, 1280),
        SplashBlocks(1536, 1536, 1536),
        SplashBlocks(512, 1024, 256, fused=True),
        SplashBlocks(1024, 1024, 256, fused=True),
        SplashBlocks(1024, 1024, 512, fused=True),
    ],
}
"""jax ``splash_attention`` blocks to try; the fused ones run forward+backward only. Chosen at
N=8192 (static estimate): 2048/2048 is the fastest forward without a mask (it needs the VMEM
limit), 1024/1024 the fastest causal one; 2048/1024 and 4096/1024 with kv compute 512 lost
to both and are left out. 1280 and 1536 as for jax ``flash_attention``. The fused backward
pays off only with kv sub-blocks: causal forward+backward at 1024/1024 takes 7.9 ms with
separate kernels, 9.5 ms fused, 6.5 ms fused with kv compute 256 and 6.3 ms with 512; fused
without sub-blocks (512 to 2048) and fused 2048/1024 lost every time. Quick: the fastest
forwards (2048/2048 without a mask, 1024/1024 causal) and forward+backward (fused, kv
compute 512)."""
TOKAMAX_BLOCKS: dict[str, list[SplashBlocks | None]] = {
    "quick": [None, SplashBlocks(1024, 1024, 1024), SplashBlocks(2048, 2048, 2048)],
    "default": [None, SplashBlocks(1024, 1024, 1024), SplashBlocks(2048, 2048, 1024)],
}
"""tokamax splash attention blocks to try (None: its own choice, 128/128 on v5e). Quick
tries jax splash's quick forward blocks too: at N=1024 without a mask, tokamax at 1024/1024
(kv compute 1024) is the fastest reference of all (static estimate, both stacks), far ahead of
its own 128/128."""


def _tokamax_unavailable() -> str | None:
    """Why tokamax's attention cannot be compared (not installed, or it fails to import), or
    None when it can."""
    if importlib.util.find_spec("tokamax") is None:
        return "tokamax is not installed: pip install 'pallas-flash-bench[tokamax]'"
    try:
        import tokamax  # noqa: F401
        from tokamax._src.ops.attention import pallas_mosaic_tpu_vjp  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason to report
        return f"tokamax does not import: {type(exc).__name__}: {exc}"
    return None


def _rpa_unavailable() -> str | None:
    """Why tpu-inference's RPA v3 cannot be compared (not installed, or its kernel fails to
    load: `rpa_reference.load_kernel`), or None when it can."""
    if importlib.util.find_spec("tpu_inference") is None:
        return f"tpu-inference is not installed: pip install --no-deps {rpa_reference.REQUIREMENT}"
    try:
        rpa_reference.load_kernel()
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason to report
        return f"its kernel does not import: {type(exc).__name__}: {exc}"
    return None


def reference_notes() -> list[str]:
    """The report's notes on the references: their VMEM limit, and each reference left out of
    the sweep or of some of its workloads, with the reason."""
    reason, rpa = _tokamax_unavailable(), _rpa_unavailable()
    return [
        "every reference program is compiled with the target core's whole VMEM as its "
        "scoped-VMEM limit (xla_tpu_scoped_vmem_limit_kib), the most our kernels request",
        *([f"tokamax-splash is not compared: {reason}"] if reason else []),
        f"tpu-inference-rpa-v3 is not compared: {rpa}" if rpa else rpa_reference.NO_INT8,
    ]


def _subjects(
    name: str,
    version: str,
    build: Callable[[Config, Workload], Callable[..., object] | None],
    configs: list[Config],
    label: Callable[[Config], str],
    arguments: Callable[[Workload], list[ArraySpec]] = array_specs,
    loop_trips: Callable[[Config, Workload, str], tuple[int, ...] | None] | None = None,
    **fields: object,
) -> list[Subject]:
    """One reference subject per configuration, compiled with the whole VMEM; ``fields``: the
    `Subject`'s other settings (``min_hbm_bytes``, ``notes``)."""
    return [
        Subject(
            name=name,
            kind="reference",
            config=label(config),
            version=f"{version}+whole-vmem",
            build=_on_one_chip(functools.partial(build, config)),
            whole_vmem=True,
            arguments=arguments,
            loop_trips=functools.partial(loop_trips, config) if loop_trips else None,
            **fields,  # type: ignore[arg-type]
        )
        for config in configs
    ]


def reference_subjects(sweep: str) -> list[Subject]:
    """The reference kernels in the sweep's (``quick`` or ``default``) configurations."""
    version = jax.__version__
    subjects = [
        *_subjects("jax-flash", version, _jax_flash_build, FLASH_BLOCKS[sweep],
                   lambda b: b.label if b else "default blocks"),
        *_subjects("jax-splash", version, _splash_build, SPLASH_BLOCKS[sweep],
                   lambda b: b.label),
        *_subjects("jax-paged", version, paged_reference.build, paged_reference.BLOCKS[sweep],
                   lambda pages: f"grid of {pages}-page blocks", paged_reference.arguments,
                   paged_reference.loop_trips),
        *_subjects("jax-ragged-paged", version, ragged_reference.build,
                   ragged_reference.BLOCKS[sweep], lambda blocks: blocks.label,
                   ragged_reference.arguments, ragged_reference.loop_trips,
                   min_hbm_bytes=ragged_reference.min_hbm_bytes, notes=ragged_reference.notes),
    ]  # fmt: skip
    if _tokamax_unavailable() is None:
        subjects += _subjects(
            "tokamax-splash", importlib.metadata.version("tokamax"), _tokamax_build,
            TOKAMAX_BLOCKS[sweep], lambda b: b.label if b else "its own blocks",
        )  # fmt: skip
    if _rpa_unavailable() is None:
        rpa = importlib.metadata.version(rpa_reference.DISTRIBUTION)
        subjects += _subjects(
            "tpu-inference-rpa-v3", f"{rpa}+donated",
            rpa_reference.build, rpa_reference.BLOCKS[sweep], lambda blocks: blocks.label,
            rpa_reference.arguments, rpa_reference.loop_trips, notes=rpa_reference.notes,
            donate=rpa_reference.donate,
        )  # fmt: skip
        subjects += _subjects(
            "tpu-inference-rpa-v3", f"{rpa}+donated", rpa_mixed.build, rpa_mixed.BLOCKS[sweep],
            lambda blocks: blocks.label, rpa_mixed.arguments, rpa_mixed.loop_trips,
            notes=rpa_mixed.notes, donate=rpa_reference.donate,
        )  # fmt: skip
    return subjects


def all_subjects(sweep: str, backends: list[str] | None, references: bool) -> dict[str, Subject]:
    """Every subject of a run by id, in report order: the installed backends (or those
    named), then with ``references`` the references of ``sweep``."""
    subjects = backend_subjects(backends) + (reference_subjects(sweep) if references else [])
    return {s.id: s for s in subjects}
