"""An independent float64 NumPy LLaMa for the tests, on Hugging Face-layout weights.

Written from the model's definition (Hugging Face's ``modeling_llama`` and Meta's Llama-3
RoPE scaling), not from the package's code: linear layers are ``x @ W.T`` with ``W [out,
in]``, K/V heads are repeated for GQA, masks are built as full matrices.
"""

from __future__ import annotations

import math

import numpy as np


def random_hf_weights(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under Hugging Face LLaMa names for config.json dict ``hf``."""
    rng = np.random.default_rng(seed)
    d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    hd = hf["head_dim"]
    qh, kvh = hf["num_attention_heads"], hf["num_key_value_heads"]

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    weights = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": norm(d)}
    if not hf["tie_word_embeddings"]:
        weights["lm_head.weight"] = w(v, d)
    for i in range(hf["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        weights |= {
            pre + "input_layernorm.weight": norm(d),
            pre + "self_attn.q_proj.weight": w(qh * hd, d),
            pre + "self_attn.k_proj.weight": w(kvh * hd, d),
            pre + "self_attn.v_proj.weight": w(kvh * hd, d),
            pre + "self_attn.o_proj.weight": w(d, qh * hd),
            pre + "post_attention_layernorm.weight": norm(d),
            pre + "mlp.gate_proj.weight": w(f, d),
            pre + "mlp.up_proj.weight": w(f, d),
            pre + "mlp.down_proj.weight": w(d, f),
        }
    return weights


def _inv_freq(hf: dict) -> np.ndarray:
    hd = hf["head_dim"]
    inv = 1.0 / hf["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    scaling = hf.get("rope_scaling")
    if not scaling:
        return inv
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in inv:  # Meta's apply_scaling, one frequency at a time
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(freq)
        elif wavelen > old / lo:
            out.append(freq / factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, positions: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """x [seq, heads, hd]; rotate_half convention."""
    angles = positions[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def logits(
    hf: dict,
    weights: dict[str, np.ndarray],
    tokens: np.ndarray,
    segment_ids: np.ndarray | None = None,
) -> np.ndarray:
    """Float64 logits ``[seq, vocab]`` of one row ``tokens [seq]`` (segments: packed docs,
    positions restarting at each document)."""
    wt = {k: v.astype(np.float64) for k, v in weights.items()}
    seq = len(tokens)
    seg = np.zeros(seq, int) if segment_ids is None else np.asarray(segment_ids)
    positions = np.zeros(seq)
    for i in range(1, seq):
        positions[i] = positions[i - 1] + 1 if seg[i] == seg[i - 1] else 0
    visible = np.tril(np.ones((seq, seq), bool)) & (seg[:, None] == seg[None, :])
    qh, kvh, hd = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    eps, inv = hf["rms_norm_eps"], _inv_freq(hf)
    x = wt["model.embed_tokens.weight"][tokens]
    for i in range(hf["num_hidden_layers"]):
        p = {k.removeprefix(f"model.layers.{i}."): v for k, v in wt.items()}
        h = _rms(x, p["input_layernorm.weight"], eps)
        q = (h @ p["self_attn.q_proj.weight"].T).reshape(seq, qh, hd)
        k = (h @ p["self_attn.k_proj.weight"].T).reshape(seq, kvh, hd)
        v = (h @ p["self_attn.v_proj.weight"].T).reshape(seq, kvh, hd)
        q, k = _rope(q, positions, inv), _rope(k, positions, inv)
        k, v = np.repeat(k, qh // kvh, axis=1), np.repeat(v, qh // kvh, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        scores = np.where(visible[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(seq, qh * hd)
        x = x + attn @ p["self_attn.o_proj.weight"].T
        h = _rms(x, p["post_attention_layernorm.weight"], eps)
        gate = h @ p["mlp.gate_proj.weight"].T
        x = (
            x
            + ((gate / (1 + np.exp(-gate))) * (h @ p["mlp.up_proj.weight"].T))
            @ p["mlp.down_proj.weight"].T
        )
    x = _rms(x, wt["model.norm.weight"], eps)
    head = wt["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else wt["lm_head.weight"]
    return x @ head.T
