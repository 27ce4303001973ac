"""Inputs laid out over a mesh as a ``shard_map`` takes them, whatever mesh the user built.

``jax.make_mesh`` (the constructor jax's docs teach) gives axes of type ``Explicit`` on this
jax, and ``shard_map`` over such a mesh requires every input to be sharded exactly as its
``in_specs`` say: a NumPy array, an array on one device, or one sharded another way is
refused. A ``jax.sharding.Mesh`` built by hand has ``Auto`` axes, which ``jit`` lays out by
itself. `place` lays the inputs out for both, so a backend's mesh layer takes the arrays as
users have them: concrete arrays (NumPy, on one device, sharded another way) by
``jax.device_put``, before the backend's own ``jit``, and traced ones (under the user's
``jit``) over an explicit mesh by ``jax.sharding.reshard``, over an auto one by a sharding
constraint. An array not yet laid out so is copied across the devices: the price of handing
over unplaced arrays (a cache placed once with ``NamedSharding`` moves nothing). Under the
user's ``jit``, jax itself refuses an argument committed to a device outside the mesh.

A backend's ``shard_map`` runs over `call_mesh`. Given inputs never laid out over an
``Explicit`` mesh (NumPy, one device) outside a mesh context (``jax.set_mesh``), that is the
mesh's ``Auto`` twin (the same devices and names), so the output's type carries no
``Explicit`` axes the inputs' did not: outside a mesh context jax's own ``jax.grad`` cannot
build a cotangent of that type eagerly ("Please enter your `jit` into a mesh context via
`jax.set_mesh`"), so the gradient of attention over ``jax.make_mesh`` of plain arrays failed
where the forward ran. Inputs already typed ``Explicit``, or a mesh context, keep the user's
mesh: the output then mixes with the user's arrays, and differentiates as theirs do.

`to_host` goes the other way: an array laid out over a mesh, whole in this process, also
when the mesh spans several processes (``jax.distributed``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

__all__ = ["call_mesh", "place", "to_host"]


def _explicit(mesh: Mesh) -> bool:
    return any(t == AxisType.Explicit for t in mesh.axis_types)


def _typed_explicit(x: Any) -> bool:
    """Whether ``x``'s type carries ``Explicit`` mesh axes (an array the user laid out over
    an ``Explicit`` mesh, or a trace of one)."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return mesh is not None and not mesh.empty and _explicit(mesh)


def call_mesh(mesh: Mesh, values: Any) -> Mesh:
    """The mesh a backend's ``shard_map`` runs over for the user's ``mesh`` and inputs
    ``values`` (a pytree of arrays; module doc): the user's inside a mesh context, where no
    axis is ``Explicit``, or where an input is typed ``Explicit`` already (the output then
    follows it, as jax's own ops do); else, for inputs that were never laid out so, its
    ``Auto`` twin."""
    if not _explicit(mesh) or not jax.sharding.get_abstract_mesh().empty:
        return mesh
    if any(_typed_explicit(x) for x in jax.tree.leaves(values)):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def place(values: Any, mesh: Mesh, specs: Any) -> Any:
    """``values`` (a pytree of arrays) laid out over ``mesh`` as ``specs`` say, as
    ``shard_map(mesh=mesh, in_specs=specs)`` takes them: ``specs`` is a prefix of ``values``,
    a `PartitionSpec` for each array or subtree of arrays (None: left as it is)."""
    explicit = _explicit(mesh)

    def subtree(spec: PartitionSpec | None, value: Any) -> Any:
        if spec is None:
            return value
        sharding = NamedSharding(mesh, spec)

        def one(x: Any) -> jax.Array:
            if not isinstance(x, jax.core.Tracer):
                return jax.device_put(x, sharding)
            if explicit:
                return jax.sharding.reshard(x, sharding)
            return jax.lax.with_sharding_constraint(x, sharding)

        return jax.tree.map(one, value)

    return jax.tree.map(subtree, specs, values,
                        is_leaf=lambda s: s is None or isinstance(s, PartitionSpec))  # fmt: skip


def to_host(x: jax.Array) -> np.ndarray:
    """``x`` whole as a numpy array in every process, gathered from the processes that hold
    its shards (a collective when it has shards in other processes: every process must call
    it)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
