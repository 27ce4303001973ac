"""Context parallelism: attention of one sequence split over the devices of a mesh.

q, k and v ``[batch, heads, seq, head_dim]`` (v: ``v_head_dim``) are split along ``seq`` over
all the mesh's devices (its axes flattened, in mesh order), each device holding ``pieces``
chunks of ``seq / (devices x pieces)`` tokens (`pallas_flash.context_layout`): chunk ``d``
(``contiguous``) or chunks ``d`` and ``2 devices - 1 - d`` (``zigzag``, which gives every
device the same share of causal work). Each device keeps its queries and passes its K/V
chunks round a ring (``ppermute``, one hop a step, ``devices`` steps) or, with
``exchange="all_gather"``, gathers every device's K/V at once (``all_gather``) and takes them a
device's worth a step, so it attends to every chunk once; the per-pair results, each a
normalised output and a log-sum-exp, merge exactly (`pallas_flash.merge`). Sinks join last,
each a part with the head's sink for its log-sum-exp and no value. (XLA's schedule for v5e
sends the forward's next K/V while a step's kernels run, the backward's after them, with
dK/dV; passing dK/dV a step behind would overlap those too but held 6-10 more q-sized
buffers a chip, AOT.)

A pair of chunks is attended to with the one-chip kernels (`forward`, `backward`), as
`ChunkPairs` says from their distance along the sequence: without a mask as is; causal, an
earlier key chunk entirely (no mask), the same chunk causally, a later one not at all (its
work skipped, its weight 0); a sliding window likewise, the pairs it cuts with the mask at
their offset. The chunk indices are traced (each device's own), so the choice is a
``lax.switch``. With ``zigzag`` and a causal mask, every ring step after the first leaves
each device exactly two of its four pairs to compute.

Backward (a custom VJP): the forward's merged output and log-sum-exp make every pair's
gradient exact on its own (`backward.flash_backward` with the global statistics, the sinks
included; the sinks' own gradient is each device's rows' share, which ``shard_map`` sums over
the mesh, the sinks being replicated). dq stays
on its device; dk and dv travel round the ring with their K/V, and the hop after the last
step brings them home (K/V, needed no more, stay); gathered, each device sums its share of
every device's dk and dv, and a reduce-scatter (``psum_scatter``) adds them up at home.
Partial results are summed in float32. Both passes loop over the ring's steps
(``lax.fori_loop``), so one step's buffers are alive at a time. When even those would not
fit beside the arrays, the heads are split into groups (whole GQA groups) that run their
rings one after another (`head_groups`): 1,048,576 causal tokens (16 heads of 128, bfloat16)
train on a v5e-4 in 16 groups at 10.9 GiB a chip (AOT memory analysis).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from pallas_flash import context_layout, tpu
from pallas_flash.context_layout import ContextExchange, ContextLayout, chunk_ids
from pallas_flash.merge import merge
from pallas_flash.mesh_placement import call_mesh, place
from pallas_flash.specs import AttentionSpec, SegmentIds
from pallas_flash_pallas.blocks.block_sizes import BlockSizes
from pallas_flash_pallas.kernels.attention import sinks_gradient
from pallas_flash_pallas.kernels.backward import flash_backward
from pallas_flash_pallas.kernels.forward import flash_forward
from pallas_flash_pallas.mesh.chunk_pairs import ChunkPairs

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static settings of one call: its spec, the mesh's axes and size, the layout's
    pieces per device, the kernels' block sizes, the head groups run one after another
    (`head_groups`) and how K/V reach every device (``ring`` or ``all_gather``)."""

    spec: AttentionSpec
    axes: tuple[str, ...]
    devices: int
    layout: ContextLayout
    block_sizes: BlockSizes
    head_groups: int = 1
    exchange: ContextExchange = "ring"

    @property
    def pieces(self) -> int:
        return context_layout.pieces(self.layout)

    def chunks(self, device: jax.Array) -> list[jax.Array]:
        """The sequence chunks ``device`` holds, in its order."""
        return chunk_ids(device, self.devices, self.layout)

    def pairs(self, chunk: int) -> ChunkPairs:
        """How each pair of this call's chunks (``chunk`` tokens) is attended to."""
        return ChunkPairs.of(self.spec, chunk, self.devices * self.pieces)

    def rotate(self, *xs: jax.Array | None) -> list[jax.Array | None]:
        """Each array one hop round the ring: device ``d``'s to ``d + 1`` (None stays None)."""
        perm = [(i, (i + 1) % self.devices) for i in range(self.devices)]
        return [None if x is None else lax.ppermute(x, self.axes, perm) for x in xs]

    def gather(self, *xs: jax.Array | None) -> list[jax.Array | None]:
        """Every device's arrays along the sequence (axis 2; segment ids ``[batch, rows]``:
        axis 1), device by device (None stays None)."""
        return [None if x is None else lax.all_gather(x, self.axes, axis=_sequence_axis(x),
                                                      tiled=True) for x in xs]  # fmt: skip

    def device_share(self, device: jax.Array, *xs: jax.Array | None) -> list[jax.Array | None]:
        """``device``'s share of each gathered array (`gather`)."""
        return [None if x is None else _device_rows(x, device, self.devices) for x in xs]


def _sequence_axis(x: jax.Array) -> int:
    """The sequence axis: 2 of ``[batch, heads, seq, dim]``, 1 of segment ids ``[batch, seq]``."""
    return 2 if x.ndim == 4 else 1


def _device_rows(x: jax.Array, device: jax.Array, devices: int) -> jax.Array:
    axis = _sequence_axis(x)
    size = x.shape[axis] // devices
    return lax.dynamic_slice_in_dim(x, device * size, size, axis=axis)


def _split(x: jax.Array, pieces: int) -> list[jax.Array]:
    return jnp.split(x, pieces, axis=2)


def _split_ids(ids: jax.Array | None, pieces: int) -> list[jax.Array | None]:
    """Segment ids ``[batch, rows]`` in the layout's pieces (None: none)."""
    return [None] * pieces if ids is None else jnp.split(ids, pieces, axis=1)


def _pair_ids(q_ids: jax.Array | None, kv_ids: jax.Array | None) -> SegmentIds | None:
    return None if q_ids is None else SegmentIds(q_ids, kv_ids)


def _pair_forward(
    ring: _Ring, q: jax.Array, k: jax.Array, v: jax.Array, ids: SegmentIds | None,
    branch: jax.Array, running: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``running`` (the query chunk's float32 output and log-sum-exp ``[batch, heads, rows]``
    so far) merged with one pair of chunks' (``branch`` of `ChunkPairs`). It goes through the
    branch, so the pairs run one after another and only the running result stays alive."""

    def attend(spec: AttentionSpec | None) -> tuple[jax.Array, jax.Array]:
        if spec is None:  # no key visible
            return running
        out, lse = flash_forward(
            q, k, v, ids, spec=spec, block_sizes=ring.block_sizes, devices=ring.devices
        )
        part = (out.astype(_F32), lse[:, :, 0, :])
        return merge(*(jnp.stack(x) for x in zip(running, part, strict=True)), 0)

    return _switch(ring.pairs(q.shape[2]), branch, attend)


def _switch(pairs: ChunkPairs, branch: jax.Array, run: Callable):
    """``run(spec)`` of the pair's branch (no switch when every pair takes the same)."""
    if len(pairs.branches) == 1:
        return run(pairs.branches[0])
    return lax.switch(branch, [functools.partial(run, spec) for spec in pairs.branches])


def _forward_pass(
    ring: _Ring, q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None,
    *, ids: SegmentIds | None,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """This device's output (q's dtype) and log-sum-exp ``[batch, heads, 1, rows]``: a loop
    over the ring's steps (one step's buffers alive at a time), K/V (and their segment ids)
    passed on after each but the last. ``sinks``: ``[1, heads]`` or None (heads on axis 1, as
    `_by_head_groups` slices them)."""
    device = lax.axis_index(ring.axes)
    mine = ring.chunks(device)
    q_pieces = _split(q, ring.pieces)
    q_ids = _split_ids(None if ids is None else ids.q, ring.pieces)

    def attend(step, k, v, kv_ids, results: list) -> list:
        theirs = ring.chunks(context_layout.kv_device(device, step, ring.devices))
        kv_pieces = list(zip(_split(k, ring.pieces), _split(v, ring.pieces),
                             _split_ids(kv_ids, ring.pieces), strict=True))  # fmt: skip
        for a, q_piece in enumerate(q_pieces):
            for b, (k_piece, v_piece, kv_ids_piece) in enumerate(kv_pieces):
                branch = ring.pairs(q_piece.shape[2]).branch(mine[a], theirs[b])
                pair_ids = _pair_ids(q_ids[a], kv_ids_piece)
                results[a] = _pair_forward(
                    ring, q_piece, k_piece, v_piece, pair_ids, branch, results[a]
                )
        return results

    def step_and_pass(step, carry):
        k, v, kv_ids, results = carry
        results = attend(step, k, v, kv_ids, list(results))
        return (*ring.rotate(k, v, kv_ids), tuple(results))

    def with_sink(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The sink merged in as one more part: output 0, log-sum-exp the head's sink."""
        sink = jnp.broadcast_to(sinks.astype(_F32)[0, None, :, None], lse.shape)
        return merge(jnp.stack([out, jnp.zeros_like(out)]), jnp.stack([lse, sink]), 0)

    def step_from_gathered(step, results):
        source = context_layout.kv_device(device, step, ring.devices)
        return tuple(attend(step, *ring.device_share(source, *gathered), list(results)))

    shape = (*q_pieces[0].shape[:3], v.shape[3])
    empty = (jnp.zeros(shape, _F32), jnp.full(shape[:3], -jnp.inf, _F32))
    kv_ids = None if ids is None else ids.kv
    if ring.exchange == "all_gather":
        gathered = ring.gather(k, v, kv_ids)
        start = (empty,) * ring.pieces
        results = list(lax.fori_loop(0, ring.devices, step_from_gathered, start))
    else:
        k, v, kv_ids, results = lax.fori_loop(
            0, ring.devices - 1, step_and_pass, (k, v, kv_ids, (empty,) * ring.pieces)
        )
        results = attend(ring.devices - 1, k, v, kv_ids, list(results))
    if sinks is not None:
        results = [with_sink(*result) for result in results]
    out = jnp.concatenate([o for o, _ in results], axis=2).astype(q.dtype)
    lse = jnp.concatenate([lse for _, lse in results], axis=2)[:, :, None, :]
    return out, lse


def _by_head_groups(ring: _Ring, pass_: Callable[..., tuple], *arrays: jax.Array | None):
    """``pass_(*arrays)``, one group of heads at a time: a loop over `_Ring.head_groups` equal
    groups of every array's axis 1 (query heads, kv heads: group ``g`` of each, so GQA's
    groups stay whole), each group's results, heads on axis 1, written in place. Only one
    group's ring buffers are alive at a time. None arrays pass through."""
    groups = ring.head_groups
    if groups == 1:
        return pass_(*arrays)

    def group(x: jax.Array | None, g: jax.Array) -> jax.Array | None:
        if x is None:
            return None
        size = x.shape[1] // groups
        return lax.dynamic_slice_in_dim(x, g * size, size, axis=1)

    first = jax.eval_shape(pass_, *(group(x, 0) for x in arrays))
    results = jax.tree.map(
        lambda r: jnp.zeros((r.shape[0], r.shape[1] * groups, *r.shape[2:]), r.dtype), first
    )

    def step(g: jax.Array, results: tuple) -> tuple:
        parts = pass_(*(group(x, g) for x in arrays))
        return jax.tree.map(
            lambda whole, part: lax.dynamic_update_slice_in_dim(
                whole, part, g * part.shape[1], axis=1
            ),
            results,
            parts,
        )

    return lax.fori_loop(0, groups, step, results)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(
    ring: _Ring, q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None,
    ids: SegmentIds | None,
) -> jax.Array:  # fmt: skip
    return _ring_forward(ring, q, k, v, sinks, ids)[0]


def _ring_forward(ring: _Ring, q, k, v, sinks, ids):
    out, lse = _by_head_groups(
        ring, functools.partial(_forward_pass, ring, ids=ids), q, k, v,
        None if sinks is None else sinks[None],
    )  # fmt: skip
    return out, (q, k, v, sinks, ids, out, lse)


def _pair_backward(
    ring: _Ring, q: jax.Array, k: jax.Array, v: jax.Array, ids: SegmentIds | None,
    out: jax.Array, lse: jax.Array, dout: jax.Array, branch: jax.Array,
    sums: tuple[jax.Array, jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """``sums`` (float32 dq, dk, dv of the pair's chunks) plus the pair's gradients (``branch``
    of `ChunkPairs`), from the merged output and log-sum-exp ``[batch, heads, 1, rows]`` of
    the query chunk. The sums go through the branch, so the pairs run one after another and
    only their sums stay alive."""

    def add(spec: AttentionSpec | None) -> tuple[jax.Array, ...]:
        if spec is None:  # no key visible
            return sums
        *grads, _ = flash_backward(
            q, k, v, ids, out, lse, dout,
            spec=spec, block_sizes=ring.block_sizes, devices=ring.devices,
        )  # fmt: skip
        return tuple(total + g.astype(_F32) for total, g in zip(sums, grads, strict=True))

    return _switch(ring.pairs(q.shape[2]), branch, add)


def _ring_backward(ring: _Ring, residuals, dout: jax.Array):
    q, k, v, sinks, ids, out, lse = residuals
    grads = _by_head_groups(
        ring, functools.partial(_backward_pass, ring, ids=ids), q, k, v,
        None if sinks is None else sinks[None], out, lse, dout,
    )  # fmt: skip
    *grads, dsinks = grads
    return (*grads, None if dsinks is None else dsinks[0], None)


def _backward_pass(
    ring: _Ring, q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None,
    out: jax.Array, lse: jax.Array, dout: jax.Array, *, ids: SegmentIds | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:  # fmt: skip
    """This device's dq, its K/V chunks' dk and dv, and (``sinks [1, heads]`` given) its
    rows' share of the sinks' gradient ``[1, heads]``: a loop over the ring's steps, dk and dv
    travelling with K/V, the hop after the last bringing them home."""
    device = lax.axis_index(ring.axes)
    mine = ring.chunks(device)
    lse_pieces = jnp.split(lse, ring.pieces, axis=3)
    rows = list(zip(_split(q, ring.pieces), _split(out, ring.pieces), lse_pieces,
                    _split(dout, ring.pieces), strict=True))  # fmt: skip
    q_ids = _split_ids(None if ids is None else ids.q, ring.pieces)

    def gradients(step, k, v, kv_ids, dk, dv, dq):
        """One ring step's gradients added to the sums of dq (this device's queries) and of
        dk, dv (the K/V chunks it holds at ``step``)."""
        theirs = ring.chunks(context_layout.kv_device(device, step, ring.devices))
        dq = list(dq)
        dk_parts, dv_parts = _split(dk, ring.pieces), _split(dv, ring.pieces)
        kv_pieces = list(zip(_split(k, ring.pieces), _split(v, ring.pieces),
                             _split_ids(kv_ids, ring.pieces), strict=True))  # fmt: skip
        for a, (q_piece, out_piece, lse_piece, do_piece) in enumerate(rows):
            for b, (k_piece, v_piece, kv_ids_piece) in enumerate(kv_pieces):
                dq[a], dk_parts[b], dv_parts[b] = _pair_backward(
                    ring, q_piece, k_piece, v_piece, _pair_ids(q_ids[a], kv_ids_piece),
                    out_piece, lse_piece, do_piece,
                    ring.pairs(q_piece.shape[2]).branch(mine[a], theirs[b]),
                    (dq[a], dk_parts[b], dv_parts[b]),
                )  # fmt: skip
        dk, dv = jnp.concatenate(dk_parts, axis=2), jnp.concatenate(dv_parts, axis=2)
        return dk, dv, tuple(dq)

    def step_and_pass(step, carry):
        """A step's gradients, then K/V (their ids) and their gradients one hop on."""
        k, v, kv_ids, dk, dv, dq = carry
        dk, dv, dq = gradients(step, k, v, kv_ids, dk, dv, dq)
        return (*ring.rotate(k, v, kv_ids, dk, dv), dq)

    def step_from_gathered(step, carry):
        """A step's gradients from the gathered K/V, added to the sums of every device's
        chunks (dk and dv for all the sequence)."""
        dk_all, dv_all, dq = carry
        source = context_layout.kv_device(device, step, ring.devices)
        dk, dv = ring.device_share(source, dk_all, dv_all)
        dk, dv, dq = gradients(step, *ring.device_share(source, *gathered), dk, dv, dq)
        start = source * dk.shape[2]
        return (lax.dynamic_update_slice_in_dim(dk_all, dk, start, axis=2),
                lax.dynamic_update_slice_in_dim(dv_all, dv, start, axis=2), dq)  # fmt: skip

    dq = tuple(jnp.zeros(q_piece.shape, _F32) for q_piece, *_ in rows)
    kv_ids = None if ids is None else ids.kv
    if ring.exchange == "all_gather":
        gathered = ring.gather(k, v, kv_ids)
        sums = (jnp.zeros(gathered[0].shape, _F32), jnp.zeros(gathered[1].shape, _F32))
        dk, dv, dq = lax.fori_loop(0, ring.devices, step_from_gathered, (*sums, dq))
        # every device's sums of one device's chunks go to that device, added on the way
        dk, dv = (lax.psum_scatter(x, ring.axes, scatter_dimension=2, tiled=True) for x in (dk, dv))
    else:
        zeros = (jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
        carry = lax.fori_loop(0, ring.devices - 1, step_and_pass, (k, v, kv_ids, *zeros, dq))
        dk, dv, dq = gradients(ring.devices - 1, *carry)
        dk, dv = ring.rotate(dk, dv)  # the last hop brings dk and dv home; K/V stay
    dq = jnp.concatenate(dq, axis=2)
    dsinks = None  # or this device's rows' share: shard_map sums a replicated input's
    if sinks is not None:
        dsinks = sinks_gradient(sinks[0], out, lse, dout)[None]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsinks


_ring_attention.defvjp(_ring_forward, _ring_backward)


RING_ARRAYS = 14
"""What a device holds through a training step's attention whatever the head groups, in
units of its share of q: q, k, v and the output's gradient, the output (saved for the
backward), dq, dk and dv, each group's slices and the loop's carried results."""

RING_TEMPORARIES = 12
"""The ring's buffers over the head groups, in those units: the K/V chunks and those
arriving, float32 dk and dv travelling and arriving, float32 dq, the kernels' per-pair
gradients. Both bound the AOT memory analysis of v5e-4, causal zigzag, 16 heads of 128,
bfloat16, forward and backward, from above: 720,896 tokens in one group took 23.0 units of
0.69 GiB a chip (bound 26), 786,432 in two groups 20.0 units of 0.75 GiB (bound 20),
1,048,576 in four 14.5 units of 1 GiB (bound 17)."""

GATHERED_PER_DEVICE = 6
"""What the ``all_gather`` exchange holds besides, per device of the mesh, in those units over
the head groups: every device's K and V and float32 sums of their dK and dV."""

HBM_SHARE = 0.95
"""The share of a chip's HBM `head_groups` fills at most."""


def head_groups(
    q: jax.Array, kv_heads: int, devices: int, generation: tpu.TpuGeneration,
    exchange: ContextExchange = "ring",
) -> int:  # fmt: skip
    """How many groups of heads the ring runs one after another: the fewest (a divisor of
    ``kv_heads``) whose buffers fit beside the arrays, `RING_ARRAYS` plus `RING_TEMPORARIES`
    (and `GATHERED_PER_DEVICE` per device for ``all_gather``) over the groups, in `HBM_SHARE`
    of the chip's HBM (else one kv head a group). Each group moves its share of the bytes;
    groups cost only the per-step latency again. ``q``: the whole ``[batch, q_heads, seq,
    head_dim]``."""
    unit = q.size * q.dtype.itemsize / devices
    temporaries = RING_TEMPORARIES + (GATHERED_PER_DEVICE * devices if exchange == "all_gather"
                                      else 0)  # fmt: skip
    for groups in (g for g in range(1, kv_heads + 1) if kv_heads % g == 0):
        if (RING_ARRAYS + temporaries / groups) * unit <= HBM_SHARE * generation.hbm_bytes:
            return groups
    return kv_heads


def context_parallel_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    spec: AttentionSpec,
    mesh: Mesh,
    layout: ContextLayout,
    block_sizes: BlockSizes,
    exchange: ContextExchange = "ring",
    sinks: jax.Array | None = None,
    segment_ids: SegmentIds | None = None,
) -> jax.Array:
    """Attention of validated self-attention inputs (``q_len == kv_len``, divisible by the
    mesh's devices times the layout's pieces; module doc), with ``sinks [q_heads]`` (every
    device's) or None and segment ids (``[batch, seq]`` each, in the layout's order, split
    like q) or None, differentiable with respect to q, k, v and sinks; returns ``[batch,
    q_heads, seq, v_head_dim]`` split like q.

    Inputs not yet laid out over the mesh (NumPy arrays, arrays on one device) are placed
    first (`place`), so the jitted ring takes them whatever device they were committed to;
    the ring runs over `call_mesh` (for inputs not typed ``Explicit`` outside
    ``jax.set_mesh``, an ``Explicit`` mesh's ``Auto`` twin: ``jax.grad`` can differentiate
    its outputs eagerly)."""
    args = (q, k, v, sinks, segment_ids)
    mesh = call_mesh(mesh, args)
    args = place(args, mesh, _in_specs(mesh))
    return _context_parallel_attention(
        *args, spec=spec, mesh=mesh, layout=layout, block_sizes=block_sizes, exchange=exchange
    )


def _in_specs(mesh: Mesh) -> tuple[PartitionSpec, ...]:
    """How q, k, v, sinks and segment ids lie over the mesh: the sequence split over every
    axis, the sinks on every device."""
    split = PartitionSpec(None, None, tuple(mesh.axis_names), None)
    return split, split, split, PartitionSpec(), PartitionSpec(None, tuple(mesh.axis_names))


@functools.partial(jax.jit, static_argnames=("spec", "mesh", "layout", "exchange", "block_sizes"))
def _context_parallel_attention(q, k, v, sinks, segment_ids, *, spec, mesh, layout, block_sizes,
                                exchange):  # fmt: skip
    groups = head_groups(q, k.shape[1], mesh.size, tpu.current_generation(), exchange)
    ring = _Ring(spec, tuple(mesh.axis_names), mesh.size, layout, block_sizes, groups, exchange)

    def attention(q, k, v, sinks, ids):
        return _ring_attention(ring, q, k, v, sinks, ids)

    in_specs = _in_specs(mesh)
    return jax.shard_map(
        attention, mesh=mesh, in_specs=in_specs, out_specs=in_specs[0], check_vma=False
    )(q, k, v, sinks, segment_ids)
