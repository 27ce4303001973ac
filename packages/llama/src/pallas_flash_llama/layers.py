"""One LLaMa decoder layer: RMSNorm, attention with RoPE, SwiGLU MLP, residuals.

Activations are ``[batch, seq, hidden]`` in the config's compute dtype; q/k/v are
``[batch, heads, seq, head_dim]``, the layout ``pf.attention`` takes. The attention itself is
a function the caller passes (`Attend`): causal self-attention for training and prefill, a
cache write plus ``pf.decode`` for a decode step. Projections are tagged with
``checkpoint_name`` (``q``, ``k``, ``v``, ``attn_out``, ``mlp_hidden``) for remat policies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.int8_weights import dot
from pallas_flash_llama.rope import apply_rope
from pallas_flash_llama.sharding import constrain

Attend = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]
"""``(q, k, v) -> (out, aux)``: q ``[batch, q_heads, seq, head_dim]``, k and v ``[batch,
kv_heads, seq, head_dim]`` (RoPE applied), out like q; ``aux`` is returned by the layer."""


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(x.dtype)


def mlp(x: jax.Array, p: dict[str, jax.Array], mesh: Mesh | None) -> jax.Array:
    """SwiGLU: ``(silu(x @ w_gate) * (x @ w_up)) @ w_down``; x ``[batch, seq, hidden]``."""
    gate = dot("bsd,df->bsf", x, p["w_gate"])
    up = dot("bsd,df->bsf", x, p["w_up"])
    hidden = checkpoint_name(jax.nn.silu(gate) * up, "mlp_hidden")
    hidden = constrain(hidden, ("batch", "seq", "act_mlp"), mesh)
    return dot("bsf,fd->bsd", hidden, p["w_down"])


def decoder_layer(
    x: jax.Array,
    p: dict[str, jax.Array],
    positions: jax.Array,
    attend: Attend,
    config: LlamaConfig,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, Any]:
    """One layer's output ``[batch, seq, hidden]`` and the ``aux`` of ``attend``.

    Args:
      x: ``[batch, seq, hidden]``.
      p: the layer's parameters (`sharding.LAYER_AXES`), matmul weights in the compute dtype
        or int8 (`int8_weights.Int8Weight`).
      positions: ``[batch, seq]`` int32 RoPE positions.
    """
    h = rms_norm(x, p["attn_norm"], config.norm_eps)
    q = checkpoint_name(dot("bsd,dhk->bhsk", h, p["wq"]), "q")
    k = checkpoint_name(dot("bsd,dhk->bhsk", h, p["wk"]), "k")
    v = checkpoint_name(dot("bsd,dhk->bhsk", h, p["wv"]), "v")
    q = constrain(apply_rope(q, positions, config), ("batch", "act_heads", "seq", "head_dim"), mesh)
    k = constrain(apply_rope(k, positions, config), ("batch", "act_heads", "seq", "head_dim"), mesh)
    v = constrain(v, ("batch", "act_heads", "seq", "head_dim"), mesh)
    out, aux = attend(q, k, v)
    out = checkpoint_name(dot("bhsk,hkd->bsd", out, p["wo"]), "attn_out")
    x = constrain(x + out, ("batch", "seq", "act_embed"), mesh)
    x = x + mlp(rms_norm(x, p["mlp_norm"], config.norm_eps), p, mesh)
    return constrain(x, ("batch", "seq", "act_embed"), mesh), aux
