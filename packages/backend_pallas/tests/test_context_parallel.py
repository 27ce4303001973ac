"""Context parallelism's head groups: how many the ring runs one after another, and that
running them so changes no result (a mesh of every host device; the conformance suite checks
the ring itself on 1 and 4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash import context_layout, tpu
from pallas_flash_conformance import inputs, reference
from pallas_flash_conformance.parity import assert_gradient_close
from pallas_flash_pallas.mesh import context_parallel
from pallas_flash_pallas.mesh.chunk_pairs import ChunkPairs


@pytest.mark.parametrize(
    ("tokens", "groups"),
    [(65_536, 1), (524_288, 1), (720_896, 2), (786_432, 2), (1_048_576, 16)],
)
def test_the_fewest_head_groups_that_fit_a_v5e_4_chip(tokens: int, groups: int) -> None:
    """16 heads of 128, bfloat16, over 4 chips: the ring's buffers shrink with the groups
    until they fit beside the arrays (1M tokens: 10.9 GiB a chip in 16 groups, AOT)."""
    q = jax.ShapeDtypeStruct((1, 16, tokens, 128), jnp.bfloat16)
    assert context_parallel.head_groups(q, 16, 4, tpu.GENERATIONS["v5e"]) == groups


@pytest.mark.parametrize(("tokens", "groups"), [(262_144, 1), (524_288, 4), (1_048_576, 16)])
def test_all_gathered_k_v_take_more_groups(tokens: int, groups: int) -> None:
    """Every device's K/V and float32 dK/dV of a group on each chip: more groups for the same
    tokens (AOT, v5e-4: 262,144 tokens in one group 11.5 GiB a chip, 1M in 16 12.3 GiB)."""
    q = jax.ShapeDtypeStruct((1, 16, tokens, 128), jnp.bfloat16)
    v5e = tpu.GENERATIONS["v5e"]
    assert context_parallel.head_groups(q, 16, 4, v5e, "all_gather") == groups


def test_groups_divide_the_kv_heads() -> None:
    q = jax.ShapeDtypeStruct((1, 12, 1 << 22, 128), jnp.bfloat16)
    assert context_parallel.head_groups(q, 6, 4, tpu.GENERATIONS["v5e"]) in (1, 2, 3, 6)
    assert context_parallel.head_groups(q, 6, 4, tpu.GENERATIONS["v5e"]) == 6


@pytest.mark.parametrize("exchange", ["ring", "all_gather"])
def test_one_kv_head_a_group_changes_nothing(monkeypatch: pytest.MonkeyPatch, exchange) -> None:
    """With no HBM to spare each kv head (and its query heads) runs its own ring (or gather):
    the output and every gradient, the sinks' included, still match the whole sequence's."""
    monkeypatch.setattr(context_parallel, "HBM_SHARE", 0.0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("seq",))
    seq = 128 * 2 * len(jax.devices())
    q, k, v = inputs.qkv(1, 4, 2, seq, seq, 64)
    sinks = inputs.normal(5, (4,), scale=2.0) + 4.0
    d_out = inputs.normal(3, q.shape)
    devices = len(jax.devices())

    def attention(q, k, v, sinks):
        zigzag = [pf.to_zigzag(x, devices) for x in (q, k, v)]
        out = pf.attention(*zigzag, causal=True, sinks=sinks, mesh=mesh,
                           context_layout="zigzag", context_exchange=exchange,
                           backend="pallas")  # fmt: skip
        return pf.from_zigzag(out, devices)

    out, vjp = jax.vjp(attention, q, k, v, sinks)
    options = dict(sm_scale=64**-0.5, causal=True, sinks=sinks)
    np.testing.assert_allclose(out, reference.attention(q, k, v, **options), atol=2e-5)
    expected = (*reference.attention_vjp(q, k, v, d_out, **options),
                reference.sinks_vjp(q, k, v, d_out, **options))  # fmt: skip
    for name, got, wanted in zip(("dq", "dk", "dv", "dsinks"), vjp(d_out), expected, strict=True):
        assert_gradient_close(got, wanted, "float32", name=name)


def _mesh(kind: str) -> jax.sharding.Mesh:
    """A mesh of every device as users build it: ``jax.make_mesh`` (axes ``Explicit`` on this
    jax) or ``Mesh`` (``Auto``)."""
    if kind == "make_mesh":
        return jax.make_mesh((len(jax.devices()),), ("seq",))
    return jax.sharding.Mesh(np.array(jax.devices()), ("seq",))


@pytest.mark.parametrize(
    ("kind", "jit", "context"),
    [("make_mesh", False, False), ("make_mesh", False, True), ("make_mesh", True, False),
     ("Mesh", False, False)],
    ids=["make_mesh-eager", "make_mesh-eager-set_mesh", "make_mesh-jit", "Mesh-eager"],
)  # fmt: skip
def test_gradients_of_plain_arrays_over_every_mesh(kind: str, jit: bool, context: bool) -> None:
    """``jax.grad`` of attention over a mesh of plain (unplaced) arrays, eager or jitted,
    inside ``jax.set_mesh`` or not: the reference's gradients. Eager over ``jax.make_mesh``
    outside a mesh context, jax refused to build the cotangent of an output typed
    ``Explicit`` (`mesh_placement.call_mesh`)."""
    mesh = _mesh(kind)
    seq = 128 * 2 * len(jax.devices())
    q, k, v = inputs.qkv(1, 2, 2, seq, seq, 64)
    d_out = inputs.normal(3, q.shape)

    def loss(q, k, v):
        out = pf.attention(q, k, v, causal=True, mesh=mesh, context_layout="zigzag",
                           backend="pallas")  # fmt: skip
        return jnp.sum(out * d_out)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    grad = jax.jit(grad) if jit else grad
    if context:
        with jax.set_mesh(mesh):
            got = grad(q, k, v)
    else:
        got = grad(q, k, v)
    zigzag = [pf.from_zigzag(x, len(jax.devices())) for x in (q, k, v, d_out)]
    expected = reference.attention_vjp(*zigzag, sm_scale=64**-0.5, causal=True)
    for name, mine, wanted in zip(("dq", "dk", "dv"), got, expected, strict=True):
        mine = pf.from_zigzag(mine, len(jax.devices()))
        assert_gradient_close(mine, wanted, "float32", name=name)


def test_inputs_laid_out_over_an_explicit_mesh_keep_it() -> None:
    """q, k, v placed over ``jax.make_mesh``: the output is typed over the same mesh, so it
    mixes with them as jax's own ops' outputs do."""
    mesh = _mesh("make_mesh")
    seq = 128 * 2 * len(jax.devices())
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "seq"))
    q, k, v = (jax.device_put(x, split) for x in inputs.qkv(1, 2, 2, seq, seq, 64))
    out = pf.attention(q, k, v, mesh=mesh, context_layout="zigzag", backend="pallas")
    assert out.sharding.mesh == mesh
    assert (out + q).shape == q.shape


def test_a_bias_over_a_mesh_raises_and_names_it() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("seq",))
    q = inputs.normal(0, (1, 2, 256, 64))
    bias = np.zeros((1, 2, 256, 256), np.float32)
    with pytest.raises(pf.UnsupportedFeatureError, match="bias with a mesh"):
        pf.attention(q, q, q, mesh=mesh, backend="pallas", bias=bias)


def test_causal_pairs_are_the_layout_s_pair_kinds() -> None:
    """Under a causal mask alone the branches are skipped, diagonal, unmasked, as
    `context_layout.pair_kind` (which the bench weighs them by) names them."""
    spec = pf.AttentionSpec(sm_scale=1.0, causal=True)
    pairs = ChunkPairs.of(spec, chunk=64, chunks=8)
    assert [s if s is None else (s.causal, s.q_offset) for s in pairs.branches] == [
        None, (True, 0), (False, 0)]  # fmt: skip
    for a in range(8):
        for b in range(8):
            assert int(pairs.branch(a, b)) == int(context_layout.pair_kind(a, b))


def test_a_window_masks_the_pairs_it_cuts_at_their_offset() -> None:
    """Chunks of 64, a causal window of 100 keys: a pair 1 chunk apart is cut (its keys
    64..127 tokens back), 2 apart too (128..191 back, the window reaching 100), 3 or more
    apart skipped, as are later keys; no pair is wholly visible."""
    spec = pf.AttentionSpec(sm_scale=1.0, causal=True, window=(100, 0))
    pairs = ChunkPairs.of(spec, chunk=64, chunks=8)
    offsets = [s.q_offset for s in pairs.branches if s is not None]
    assert pairs.branches[0] is None and offsets == [0, 64, 128]
    kinds = [pairs.branches[int(pairs.branch(5, b))] for b in range(8)]
    assert [k if k is None else k.q_offset for k in kinds] == [
        None, None, None, 128, 64, 0, None, None]  # fmt: skip
    wide = pf.AttentionSpec(sm_scale=1.0, window=(200, 200))  # both sides, not causal
    pairs = ChunkPairs.of(wide, chunk=64, chunks=8)
    full = pairs.branches[int(pairs.branch(4, 4))]  # 63 back and ahead at most: all visible
    assert full.window is None and not full.causal
