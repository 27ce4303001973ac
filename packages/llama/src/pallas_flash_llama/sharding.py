"""How the model is laid out over a mesh: one table of rules from logical to mesh axes.

Every parameter and activation names its axes logically (``("batch", "seq", "embed")``);
`RULES` maps each logical axis to the mesh axes that partition it. The mesh has three axes:

- ``data``: pure data parallelism (each group holds a full copy of the parameters);
- ``fsdp``: data parallelism whose parameters and optimiser state are sharded over it
  (gathered layer by layer by XLA when used);
- ``tensor``: Megatron-style tensor parallelism over heads and the MLP width.

The same code runs with one device (every axis of size 1), on 4 host CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``) and on a v5e slice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_flash as pf
from pallas_flash_llama.config import LlamaConfig

MESH_AXES = ("data", "fsdp", "tensor")

BATCH_AXES = ("data", "fsdp")
"""The mesh axes a batch is split over."""

RULES: dict[str, str | tuple[str, ...] | None] = {
    # activations
    "batch": BATCH_AXES,
    "seq": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    # parameters
    "layers": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
}
"""Logical axis -> the mesh axes that partition it (None: replicated)."""

LAYER_AXES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("norm",),
    "wq": ("embed", "q_heads", "head_dim"),
    "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"),
    "wo": ("q_heads", "head_dim", "embed"),
    "mlp_norm": ("norm",),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
}
"""Logical axes of one decoder layer's parameters (stacked layers add ``layers`` in front)."""

TOP_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "final_norm": ("norm",),
    "lm_head": ("embed", "vocab"),
}
"""Logical axes of the parameters outside the layers."""


def spec(axes: Sequence[str]) -> PartitionSpec:
    """The ``PartitionSpec`` of an array whose axes have these logical names."""
    return PartitionSpec(*(RULES[name] for name in axes))


def param_axes(config: LlamaConfig) -> dict:
    """The logical axes of every parameter, a pytree shaped like `model.init_params`'s."""
    axes: dict = {name: TOP_AXES[name] for name in ("embed", "final_norm")}
    if not config.tie_embeddings:
        axes["lm_head"] = TOP_AXES["lm_head"]
    axes["layers"] = {name: ("layers", *a) for name, a in LAYER_AXES.items()}
    return axes


def param_shardings(config: LlamaConfig, mesh: Mesh) -> dict:
    """A ``NamedSharding`` for every parameter, a pytree shaped like the parameters."""
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, spec(axes)),
        param_axes(config),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def make_mesh(
    data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all); one size may be -1:
    the devices left over.

    Raises:
      pf.InvalidInputError: the sizes do not multiply to the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise pf.InvalidInputError(f"mesh: at most one axis size may be -1, got {sizes}")
    if -1 in sizes:
        rest = len(devices) // math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = rest
    if math.prod(sizes) != len(devices) or min(sizes) < 1:
        raise pf.InvalidInputError(
            f"mesh: expected (data, fsdp, tensor) sizes whose product is the {len(devices)} "
            f"devices, got {tuple(sizes)}"
        )
    return Mesh(np.array(devices).reshape(sizes), MESH_AXES)


def batch_parts(mesh: Mesh) -> int:
    """How many ways a batch is split over ``mesh``."""
    return math.prod(mesh.shape[name] for name in BATCH_AXES)


def check_mesh(config: LlamaConfig, mesh: Mesh, batch: int | None = None) -> None:
    """Checks that ``mesh`` divides what `RULES` splits over it.

    Raises:
      pf.InvalidInputError: the tensor axis does not divide the heads, MLP width or
        vocabulary, the fsdp axis does not divide the width, or the batch axes the batch.
    """
    if tuple(mesh.axis_names) != MESH_AXES:
        raise pf.InvalidInputError(
            f"mesh: expected axes {MESH_AXES} (see make_mesh), got {tuple(mesh.axis_names)}"
        )
    tensor, fsdp = mesh.shape["tensor"], mesh.shape["fsdp"]
    divided = {
        "q_heads": (config.q_heads, tensor, "tensor"),
        "kv_heads": (config.kv_heads, tensor, "tensor"),
        "mlp": (config.mlp, tensor, "tensor"),
        "vocab": (config.vocab, tensor, "tensor"),
        "hidden": (config.hidden, fsdp, "fsdp"),
    }
    if batch is not None:
        divided["batch"] = (batch, batch_parts(mesh), "data x fsdp")
    for name, (size, parts, axis) in divided.items():
        if size % parts:
            raise pf.InvalidInputError(
                f"mesh: its {axis} axes ({parts} devices) must divide {name}={size}; "
                "choose other mesh sizes"
            )


def constrain(x: jax.Array, axes: Sequence[str], mesh: Mesh | None) -> jax.Array:
    """``x`` constrained to the sharding of its logical ``axes`` (unchanged without a mesh)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(axes)))
