"""Context parallelism: ``pf.attention(..., mesh=...)`` over every device against the float64
reference of the whole sequence, forward and gradients, contiguous and zigzag, K/V passed
round a ring or all gathered, under causal masks, windows, segment ids and sinks.

Run with one device (a mesh of one: nothing exchanged) and, by ``nox -s conformance``, again
with 4 host devices (`HOST_DEVICES_FLAG`), where the K/V chunks go round a ring of 4.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_conformance import inputs, reference
from pallas_flash_conformance.calls import Case
from pallas_flash_conformance.parity import FORWARD_TOLERANCE, assert_close, assert_gradient_close


def _mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()), ("seq",))


@dataclasses.dataclass(frozen=True)
class Split:
    """A `Case` of self-attention whose sequence is ``chunk`` tokens a chunk, split over every
    device in ``layout``, K/V exchanged by ``exchange``."""

    case: Case
    layout: str
    exchange: str = "ring"

    @classmethod
    def of(cls, chunk: int, layout: str, exchange: str = "ring", **kwargs) -> Split:
        pieces = 2 if layout == "zigzag" else 1
        seq = chunk * pieces * len(jax.devices())
        return cls(Case(kv_len=seq, q_len=seq, **kwargs), layout, exchange)

    def arrays(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.case.arrays()

    def run(
        self, backend: str, q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None
    ) -> jax.Array:
        """The call on tokens in order: put into the layout's order and back around it."""
        devices = len(jax.devices())
        to, back = (pf.to_zigzag, pf.from_zigzag) if self.layout == "zigzag" else (None, None)
        ids = self.case.segment_ids()
        if to is not None:
            q, k, v = (to(x, devices) for x in (q, k, v))
            ids = None if ids is None else pf.SegmentIds(*(to(x, devices, 1) for x in ids))
        out = pf.attention(
            q, k, v, causal=self.case.causal, softcap=self.case.softcap, sinks=sinks,
            sliding_window=self.case.sliding_window,
            segment_ids=ids, mesh=_mesh(), context_layout=self.layout,
            context_exchange=self.exchange, backend=backend,
        )  # fmt: skip
        return out if back is None else back(out, devices)


CASES = {
    # 96-token chunks: every kernel call has partial blocks
    "causal-zigzag-gqa": Split.of(
        96, "zigzag", batch=1, q_heads=4, kv_heads=2, head_dim=64, causal=True
    ),
    "causal-contiguous-mla": Split.of(
        64, "contiguous", batch=1, q_heads=2, kv_heads=2, head_dim=64, v_head_dim=32, causal=True
    ),
    "full-contiguous-softcap": Split.of(
        64, "contiguous", batch=2, q_heads=2, kv_heads=1, head_dim=64, softcap=2.0, q_scale=3.0
    ),
    "causal-zigzag-sinks": Split.of(
        64, "zigzag", batch=2, q_heads=4, kv_heads=2, head_dim=64, causal=True, sinks=True
    ),
    "causal-zigzag-segments": Split.of(
        96, "zigzag", batch=2, q_heads=2, kv_heads=2, head_dim=64, causal=True, segments=3
    ),
    "full-contiguous-segments-gqa": Split.of(
        64, "contiguous", batch=1, q_heads=4, kv_heads=2, head_dim=64, segments=4
    ),
    "causal-zigzag-sinks-segments-gathered": Split.of(
        96, "zigzag", "all_gather", batch=2, q_heads=4, kv_heads=2, head_dim=64, causal=True,
        sinks=True, segments=3),
    # a window crossing chunk boundaries: the pairs it cuts are masked at their offset
    "causal-zigzag-window": Split.of(
        64, "zigzag", batch=1, q_heads=2, kv_heads=2, head_dim=64, causal=True,
        sliding_window=100),
    "full-contiguous-window-gathered": Split.of(
        64, "contiguous", "all_gather", batch=1, q_heads=2, kv_heads=1, head_dim=64,
        sliding_window=(70, 30)),
    "full-contiguous-mla-gathered": Split.of(
        64, "contiguous", "all_gather", batch=1, q_heads=2, kv_heads=1, head_dim=64,
        v_head_dim=32),
}  # fmt: skip


def _param(name: str, *extra: str):
    split = CASES[name]
    needs = ("context_parallel", *split.case.required(), *extra)
    return pytest.param(split, id=name, marks=pytest.mark.requires(*needs))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("split", [_param(name) for name in CASES])
def test_matches_the_whole_sequence(backend, split: Split, dtype: str) -> None:
    split = dataclasses.replace(split, case=dataclasses.replace(split.case, dtype=dtype))
    q, k, v = split.arrays()
    expected = reference.attention(q, k, v, **split.case.reference_kwargs())
    out = split.run(backend.name, q, k, v, split.case.sink_logits())
    assert_close(out, expected, FORWARD_TOLERANCE[dtype])


USER_CALLS = [
    ("make_mesh", "numpy", False), ("make_mesh", "numpy", True),
    ("make_mesh", "one_device", False), ("make_mesh", "sharded", True),
    ("Mesh", "one_device", True), ("Mesh", "sharded", False),
]  # fmt: skip
"""(mesh, inputs, jitted): every kind of mesh, inputs and call at least once with each other."""


@pytest.mark.parametrize(("kind", "placed", "jit"), USER_CALLS, ids=["-".join(
    (kind, placed, "jit" if jit else "eager")) for kind, placed, jit in USER_CALLS])  # fmt: skip
@pytest.mark.parametrize("split", [_param("full-contiguous-segments-gqa")])
def test_takes_arrays_as_users_have_them(backend, split: Split, kind: str, placed: str, jit: bool):
    """A mesh from ``jax.make_mesh`` (axes ``Explicit`` on this jax) or ``jax.sharding.Mesh``
    (axes ``Auto``); NumPy inputs, inputs committed to one device (under the user's jit, which
    refuses those: on the default device uncommitted) or already split over the mesh: laid
    out over the mesh by the backend, eager or under the user's jit."""
    devices = jax.devices()
    if kind == "make_mesh":
        mesh = jax.make_mesh((len(devices),), ("seq",))
    else:
        mesh = jax.sharding.Mesh(np.array(devices), ("seq",))
    q, k, v = (np.asarray(x) for x in split.arrays())
    ids = pf.SegmentIds(*(np.asarray(x) for x in split.case.segment_ids()))
    expected = reference.attention(q, k, v, **split.case.reference_kwargs())
    args = [q, k, v, ids]
    if placed == "one_device":
        args = jax.tree.map(lambda x: jax.device_put(x, devices[-1]) if not jit
                            else jax.numpy.asarray(x), args)  # fmt: skip
    elif placed == "sharded":
        over_seq = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "seq"))
        args[:3] = [jax.device_put(x, over_seq) for x in args[:3]]

    def call(q, k, v, ids):
        return pf.attention(q, k, v, segment_ids=ids, mesh=mesh, backend=backend.name)

    out = (jax.jit(call) if jit else call)(*args)
    assert_close(out, expected, FORWARD_TOLERANCE["float32"])


@pytest.mark.parametrize("split", [_param(name, "grad") for name in CASES])
def test_gradients_match_the_whole_sequence(backend, split: Split) -> None:
    """dq, dk, dv (and the sinks', summed over every device's rows)."""
    q, k, v = split.arrays()
    sinks = (split.case.sink_logits(),) if split.case.sinks else ()
    d_out = inputs.normal(3, (*q.shape[:-1], v.shape[-1]))

    @jax.jit
    def gradients(d_out, *primals):
        def attention(q, k, v, *sinks):
            return split.run(backend.name, q, k, v, *sinks or [None])

        return jax.vjp(attention, *primals)[1](d_out)

    options = split.case.reference_kwargs()
    expected = reference.attention_vjp(q, k, v, d_out, **options)
    if sinks:
        expected = (*expected, reference.sinks_vjp(q, k, v, d_out, **options))
    actual = gradients(d_out, q, k, v, *sinks)
    assert len(actual) == len(expected)
    for name, got, wanted in zip(("dq", "dk", "dv", "dsinks"), actual, expected, strict=False):
        assert_gradient_close(got, wanted, "float32", name=name)


@pytest.mark.requires("context_parallel")
@pytest.mark.parametrize(
    ("argument", "kwargs", "shapes"),
    [
        ("q", {"context_layout": "zigzag"}, ((1, 2, 2 * len(jax.devices()) + 1, 64),) * 3),
        ("k", {}, ((1, 2, 8 * len(jax.devices()), 64), (1, 2, 16 * len(jax.devices()), 64))),
        ("context_layout", {"context_layout": "striped"}, ((1, 2, 8, 64),) * 3),
        ("context_exchange", {"context_exchange": "ulysses"}, ((1, 2, 8, 64),) * 3),
        ("mesh", {"mesh": "seq"}, ((1, 2, 8, 64),) * 3),
    ],
    ids=[
        "seq-not-divisible",
        "kv-len-not-q-len",
        "unknown-layout",
        "unknown-exchange",
        "mesh-not-a-mesh",
    ],
)
def test_bad_split_names_the_argument(backend, argument: str, kwargs: dict, shapes) -> None:
    q_shape, k_shape = shapes[0], shapes[1]
    q, k = inputs.normal(0, q_shape), inputs.normal(1, k_shape)
    kwargs = {"mesh": _mesh(), **kwargs}
    with pytest.raises(pf.InvalidInputError) as error:
        pf.attention(q, k, k, backend=backend.name, **kwargs)
    assert str(error.value).startswith(f"{argument}: expected"), str(error.value)
