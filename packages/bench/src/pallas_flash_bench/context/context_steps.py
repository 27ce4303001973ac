"""Compile a context-parallel workload's two programs and estimate them (in the worker).

``ring`` (its name whichever the exchange): forward and backward of ``pf.attention(...,
mesh=, context_layout=, context_exchange=)`` on the ``pallas`` backend, the sequence split
over every chip of the slice (a 1-D mesh in ``jax.make_mesh``'s order, a ring of neighbours
on v5e), the output's gradient donated. ``one chip``: the same call without a mesh at the
reference's length. Both are estimated as whole programs (`whole_program`), the ring's
``lax.switch`` over a pair of chunks weighed by how often the busiest device takes each
branch (`context_layout.ring_pair_kinds`; with zigzag every device takes the same) and each
kernel charged as the pair it attends to: a diagonal pair causally, the others without a
mask.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import pallas_flash as pf
from pallas_flash import context_layout
from pallas_flash_bench import aot
from pallas_flash_bench.context.context_workloads import ContextWorkload
from pallas_flash_bench.kernels.workloads import Workload
from pallas_flash_estimate.aot.compiled import compile_program
from pallas_flash_estimate.aot.devices import target_devices
from pallas_flash_estimate.evaluate import program_loops
from pallas_flash_estimate.program.whole_program import compiled_estimate
from pallas_flash_estimate.read import hlo, hlo_ops
from pallas_flash_estimate.read.hlo import Computation, HloOp
from pallas_flash_estimate.targets import TARGETS

DIAGONAL = context_layout.PAIR_KINDS.index("diagonal")
FORWARD_KERNEL = "pallas_flash_forward"
"""The name the pallas backend gives its forward kernel (``pallas_call(name=...)``)."""


def _step(mesh: jax.sharding.Mesh | None, w: ContextWorkload):
    """Jitted ``(q, k, v, do) -> (out, dq, dk, dv)``, ``do`` donated."""

    def attention(q, k, v):
        return pf.attention(q, k, v, causal=w.causal, backend="pallas", mesh=mesh,
                            context_layout=w.layout, context_exchange=w.exchange)  # fmt: skip

    def step(q, k, v, do):
        out, vjp = jax.vjp(attention, q, k, v)
        return (out, *vjp(do))

    return jax.jit(step, donate_argnums=(3,))


def _arguments(w: ContextWorkload, seq_len: int, mesh) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Abstract q, k, v, do ``[1, heads, seq_len, head_dim]`` bfloat16, split along the
    sequence over ``mesh`` (None: one chip)."""
    sharding = None
    if mesh is not None:
        sharding = NamedSharding(mesh, PartitionSpec(None, None, mesh.axis_names, None))
    shape = lambda heads: jax.ShapeDtypeStruct(  # noqa: E731
        (1, heads, seq_len, w.head_dim), jnp.bfloat16, sharding=sharding
    )
    return shape(w.q_heads), shape(w.kv_heads), shape(w.kv_heads), shape(w.q_heads)


def busiest_pairs(w: ContextWorkload) -> dict[str, int]:
    """The pairs of each kind the busiest device attends to over the ring (the most
    unmasked, then diagonal): every ring step waits for it."""
    counts = [context_layout.ring_pair_kinds(d, w.chips, w.layout) for d in range(w.chips)]
    return max(counts, key=lambda c: (c["unmasked"], c["diagonal"]))


def _ring_branch_shares(w: ContextWorkload) -> program_loops.BranchShares:
    """How often the busiest device takes each branch of the ring's switch over pair kinds."""
    kinds = busiest_pairs(w)
    shares = tuple(kinds[k] / sum(kinds.values()) for k in context_layout.PAIR_KINDS)

    def branch_shares(op: HloOp):
        ring_switch = len(program_loops.branches(op)) == len(shares)
        return shares if w.causal and ring_switch else None

    return branch_shares


def _ring_occupancy(
    w: ContextWorkload, groups: int, comps: Mapping[str, Computation]
) -> Callable[[str], Workload]:
    """What each Pallas kernel of the compiled ring (its parsed HLO ``comps``) runs: one chunk
    pair's forward and backward over a head group, causal in the switch's diagonal branch."""
    chunk = w.seq_len // (w.chips * context_layout.pieces(w.layout))
    branches = program_loops.enclosing_branches(comps)

    def kernel_workload(name: str) -> Workload:
        diagonal = w.causal and branches.get(name, ("", -1))[1] == DIAGONAL
        return Workload("forward_backward", chunk, diagonal, q_heads=w.q_heads // groups,
                        kv_heads=w.kv_heads // groups, head_dim=w.head_dim)  # fmt: skip

    return kernel_workload


def kernel_head_groups(w: ContextWorkload, comps: Mapping[str, Computation]) -> int:
    """How many groups of heads the compiled ring (its parsed HLO ``comps``) attends to one
    after another: the workload's query heads over those of one forward kernel call, whose
    first result is its output ``[batch, heads, chunk, head_dim]``."""
    calls = [op for comp in comps.values() for op in comp.ops
             if hlo_ops.is_kernel_call(op) and op.name.startswith(FORWARD_KERNEL)]  # fmt: skip
    if not calls:
        raise ValueError(f"the compiled ring calls no {FORWARD_KERNEL} kernel")
    _, dims, _ = hlo.arrays(calls[0].shape)[0]
    return w.q_heads // dims[1]


def analyse_context(w: ContextWorkload, dump_dir: pathlib.Path | None) -> dict:
    """Both programs of ``w`` compiled and estimated: ``{"workload", "head_groups",
    "pair_kinds", "programs": [ring, one chip]}``; ``head_groups`` as the compiled ring's
    kernels show them (`kernel_head_groups`; None where the ring did not compile)."""
    target = TARGETS[w.target]
    mesh = jax.make_mesh((w.chips,), (aot.MESH_AXIS,), devices=target_devices(target))
    ring_args = _arguments(w, w.seq_len, mesh)
    ring = compile_program("ring", _step(mesh, w), ring_args, target, dump_dir)
    comps = None if ring.text is None else hlo.parse_computations(ring.text)
    groups = None if comps is None else kernel_head_groups(w, comps)
    ring_result = ring.result
    if groups is not None:
        occupancy = _ring_occupancy(w, groups, comps)
        ring_result = compiled_estimate(ring, occupancy, target, w.chips, _ring_branch_shares(w))
    one_chip_args = _arguments(w, w.reference_len, None)
    one_chip = compile_program("one chip", _step(None, w), one_chip_args, target, dump_dir)
    reference = w.attention(w.reference_len)
    return {
        "workload": w.to_json(),
        "head_groups": groups,
        "pair_kinds": busiest_pairs(w),
        "programs": [ring_result, compiled_estimate(one_chip, lambda _: reference, target, 1)],
    }
