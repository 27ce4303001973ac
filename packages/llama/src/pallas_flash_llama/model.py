"""The LLaMa model as a plain pytree of arrays and pure functions.

Parameters (`init_params`): a dict, matmul weights laid out input-axis first::

    embed       [vocab, hidden]
    layers      one dict, each array stacked over layers ([layers, ...]):
      attn_norm [layers, hidden]            wq  [layers, hidden, q_heads, head_dim]
      wk, wv    [layers, hidden, kv_heads, head_dim]
      wo        [layers, q_heads, head_dim, hidden]
      mlp_norm  [layers, hidden]            w_gate, w_up [layers, hidden, mlp]
      w_down    [layers, mlp, hidden]
    final_norm  [hidden]
    lm_head     [hidden, vocab]             (absent with tied embeddings)

Layers run with ``lax.scan`` over the stacked axis (one layer compiled, whatever the depth),
or with ``config.scan_layers`` False as a Python loop over per-layer slices (every layer
compiled), under the config's remat policy. Norm weights stay float32; matmul weights are
cast to the compute dtype (`compute_params`); logits are float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pallas_flash_llama import sharding
from pallas_flash_llama.attention import self_attention
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.int8_weights import dot, is_int8
from pallas_flash_llama.layers import decoder_layer, rms_norm

Params = dict[str, Any]

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_qkv": jax.checkpoint_policies.save_only_these_names("q", "k", "v"),
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def param_shapes(config: LlamaConfig) -> Params:
    """The shape of every parameter, a pytree shaped like the parameters."""
    c, n = config, config.layers
    shapes: Params = {
        "embed": (c.vocab, c.hidden),
        "final_norm": (c.hidden,),
        "layers": {
            "attn_norm": (n, c.hidden),
            "wq": (n, c.hidden, c.q_heads, c.head_dim),
            "wk": (n, c.hidden, c.kv_heads, c.head_dim),
            "wv": (n, c.hidden, c.kv_heads, c.head_dim),
            "wo": (n, c.q_heads, c.head_dim, c.hidden),
            "mlp_norm": (n, c.hidden),
            "w_gate": (n, c.hidden, c.mlp),
            "w_up": (n, c.hidden, c.mlp),
            "w_down": (n, c.mlp, c.hidden),
        },
    }
    if not c.tie_embeddings:
        shapes["lm_head"] = (c.hidden, c.vocab)
    return shapes


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)


def init_params(config: LlamaConfig, key: jax.Array, mesh: Mesh | None = None) -> Params:
    """Random parameters in ``config.param_dtype``: norms 1, the embedding N(0, 0.02), matmul
    weights N(0, 1 / fan_in) (fan_in: the input axes). With a mesh, each is created in place
    with its sharding (`sharding.param_shardings`)."""
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.flatten_with_path(shapes, _is_shape)[0]]
    dtype = jnp.dtype(config.param_dtype)

    def init_one(shape: tuple[int, ...], path: str, key: jax.Array) -> jax.Array:
        if "norm" in path:
            return jnp.ones(shape, dtype)
        if path == "['embed']":
            return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        stacked = path.startswith("['layers']")
        fan_in = _fan_in(path, shape[1:] if stacked else shape)
        return (jax.random.normal(key, shape, jnp.float32) / fan_in**0.5).astype(dtype)

    def init_all(key: jax.Array) -> Params:
        keys = jax.random.split(key, len(leaves))
        return treedef.unflatten(
            [init_one(s, p, k) for s, p, k in zip(leaves, paths, keys, strict=True)]
        )

    out_shardings = None if mesh is None else sharding.param_shardings(config, mesh)
    return jax.jit(init_all, out_shardings=out_shardings)(key)


def _fan_in(path: str, shape: tuple[int, ...]) -> int:
    """Input width of a matmul weight of one layer (``wo``: heads x head_dim; others: axis 0)."""
    return shape[0] * shape[1] if path.endswith("['wo']") else shape[0]


def compute_params(params: Params, config: LlamaConfig) -> Params:
    """``params`` with matmul weights (rank >= 2) in the compute dtype; norms and int8
    weights (`int8_weights.Int8Weight`) unchanged."""
    dtype = jnp.dtype(config.dtype)

    def cast(x: Any) -> Any:
        return x if is_int8(x) or x.ndim < 2 else x.astype(dtype)

    return jax.tree.map(cast, params, is_leaf=is_int8)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """``[batch, seq]`` position of each token within its segment (0 at each segment start)."""
    index = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)[None, :]
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def embed(params: Params, tokens: jax.Array, config: LlamaConfig) -> jax.Array:
    """``[batch, seq, hidden]`` embeddings of ``tokens [batch, seq]`` in the compute dtype."""
    return params["embed"].astype(config.dtype)[tokens]


def unembed(params: Params, x: jax.Array, config: LlamaConfig) -> jax.Array:
    """Float32 logits ``[..., vocab]`` of final hidden states ``x [..., hidden]``."""
    x = rms_norm(x, params["final_norm"], config.norm_eps)
    head = params["embed"].T if config.tie_embeddings else params["lm_head"]
    head = head if is_int8(head) else head.astype(x.dtype)
    return dot("...d,dv->...v", x, head, preferred_element_type=jnp.float32)


def hidden_states(
    params: Params,
    tokens: jax.Array,
    config: LlamaConfig,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    backend: str | None = None,
    mesh: Mesh | None = None,
    keep_kv: bool = False,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """The last layer's output ``[batch, seq, hidden]`` (before the final norm), and with
    ``keep_kv`` every layer's keys and values ``[layers, batch, kv_heads, seq, head_dim]``.

    Args: as `forward`.
    """
    if segment_ids is not None and positions is None:
        positions = segment_positions(segment_ids)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    p = compute_params(params, config)
    x = sharding.constrain(embed(p, tokens, config), ("batch", "seq", "act_embed"), mesh)

    def attend(q, k, v):
        out = self_attention(q, k, v, segment_ids, backend=backend, mesh=mesh)
        return out, (k, v) if keep_kv else None

    def layer(x, layer_params):
        return decoder_layer(x, layer_params, positions, attend, config, mesh)

    if config.remat != "none":
        layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[config.remat])
    if config.scan_layers:
        return jax.lax.scan(layer, x, p["layers"])
    outs = []
    for i in range(config.layers):
        x, out = layer(x, jax.tree.map(lambda a, i=i: a[i], p["layers"]))
        outs.append(out)
    return x, None if outs[0] is None else jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def forward(
    params: Params,
    tokens: jax.Array,
    config: LlamaConfig,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    backend: str | None = None,
    mesh: Mesh | None = None,
) -> jax.Array:
    """Float32 logits ``[batch, seq, vocab]`` of ``tokens [batch, seq]`` int32.

    Args:
      positions: ``[batch, seq]`` int32 RoPE positions; default: the index in the row, or the
        index in the segment when ``segment_ids`` is given.
      segment_ids: ``[batch, seq]`` int32 document of each token for packed sequences
        (attention stays within a document).
      backend: the ``pf.attention`` backend by name; default: the registry's choice.
      mesh: a ``(data, fsdp, tensor)`` mesh (`sharding.make_mesh`) the params are sharded
        over; activations are constrained by `sharding.RULES`.
    """
    x, _ = hidden_states(
        params,
        tokens,
        config,
        positions=positions,
        segment_ids=segment_ids,
        backend=backend,
        mesh=mesh,
    )
    logits = unembed(params, x, config)
    return sharding.constrain(logits, ("batch", "seq", "act_vocab"), mesh)
