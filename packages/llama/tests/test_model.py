"""The model's logits against an independent float64 NumPy LLaMa, on Hugging Face weights."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import llama_reference as reference
import numpy as np
import pytest
from llama_testing import TINY_HF

import pallas_flash as pf
from pallas_flash_llama import model
from pallas_flash_llama.config import LlamaConfig
from pallas_flash_llama.weights import load_params

TOL = dict(rtol=2e-4, atol=2e-4)


@pytest.fixture(scope="module")
def loaded(hf_dir):
    directory, weights = hf_dir
    config, params = load_params(directory)
    return config.replace(dtype="float32"), params, weights


def _tokens(seed: int, shape: tuple[int, int], vocab: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_logits_match_float64_numpy(loaded, backend: str) -> None:
    config, params, weights = loaded
    tokens = _tokens(0, (2, 48), config.vocab)
    got = jax.jit(lambda p, t: model.forward(p, t, config, backend=backend))(params, tokens)
    assert got.dtype == jnp.float32 and got.shape == (2, 48, config.vocab)
    for row in range(2):
        want = reference.logits(TINY_HF, weights, tokens[row])
        np.testing.assert_allclose(np.asarray(got[row]), want, **TOL)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_packed_sequences_match_float64_numpy(loaded, backend: str) -> None:
    """Segment ids keep documents apart and restart their positions."""
    config, params, weights = loaded
    tokens = _tokens(1, (1, 40), config.vocab)
    segments = np.array([[1] * 13 + [2] * 20 + [3] * 7], np.int32)
    got = model.forward(params, tokens, config, segment_ids=segments, backend=backend)
    want = reference.logits(TINY_HF, weights, tokens[0], segments[0])
    np.testing.assert_allclose(np.asarray(got[0]), want, **TOL)
    # the second document alone gives the same logits as inside the pack
    alone = model.forward(params, tokens[:, 13:33], config, backend=backend)
    np.testing.assert_allclose(np.asarray(alone[0]), np.asarray(got[0, 13:33]), **TOL)


def test_bfloat16_compute_stays_close(loaded) -> None:
    config, params, weights = loaded
    tokens = _tokens(2, (1, 32), config.vocab)
    got = model.forward(params, tokens, config.replace(dtype="bfloat16"), backend="xla")
    assert got.dtype == jnp.float32
    want = reference.logits(TINY_HF, weights, tokens[0])
    error = np.abs(np.asarray(got[0]) - want).max() / np.abs(want).max()
    assert error < 0.05, error


@pytest.mark.parametrize("policy", ["full", "save_qkv", "save_dots"])
def test_remat_policies_give_the_same_gradients(loaded, policy: str) -> None:
    config, params, _ = loaded
    tokens = _tokens(3, (2, 32), config.vocab)

    def loss(p, cfg):
        return model.forward(p, tokens, cfg, backend="xla").mean()

    want = jax.grad(loss)(params, config)
    got = jax.jit(jax.grad(loss), static_argnums=1)(params, config.replace(remat=policy))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_remat_tags_name_the_projections(loaded) -> None:
    """The names the remat policies save by are in the traced program."""
    config, params, _ = loaded
    tokens = _tokens(4, (1, 16), config.vocab)
    text = str(jax.make_jaxpr(lambda p: model.forward(p, tokens, config, backend="xla"))(params))
    for name in ("q", "k", "v", "attn_out", "mlp_hidden"):
        assert f"name={name}\n" in text or f"name={name} " in text or f"name={name}]" in text, name


@pytest.mark.parametrize("remat", ["none", "save_qkv"])
def test_unrolled_layers_match_the_scan(loaded, remat: str) -> None:
    """``scan_layers=False`` (a Python loop over layer slices) computes what the scan does:
    logits, gradients, and the stacked keys and values (None without ``keep_kv``)."""
    config, params, _ = loaded
    scanned = config.replace(remat=remat)
    unrolled = scanned.replace(scan_layers=False)
    tokens = _tokens(5, (2, 24), config.vocab)

    @functools.partial(jax.jit, static_argnums=1)
    def run(p, cfg):
        _, kv = model.hidden_states(p, tokens, cfg, backend="xla", keep_kv=True)
        grads = jax.grad(lambda p: model.forward(p, tokens, cfg, backend="xla").mean())(p)
        return model.forward(p, tokens, cfg, backend="xla"), kv, grads

    want, got = run(params, scanned), run(params, unrolled)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert got[1][0].shape == (config.layers, 2, config.kv_heads, 24, config.head_dim)
    assert model.hidden_states(params, tokens, unrolled, backend="xla")[1] is None
    jaxprs = [str(jax.make_jaxpr(run, static_argnums=1)(params, c)) for c in (scanned, unrolled)]
    assert "scan[" in jaxprs[0] and "scan[" not in jaxprs[1]


def test_scan_layers_must_be_a_bool() -> None:
    fields = dict(vocab=8, hidden=8, layers=1, q_heads=1, kv_heads=1, head_dim=8, mlp=8)
    with pytest.raises(pf.InvalidInputError, match="scan_layers"):
        LlamaConfig(**fields, scan_layers="yes")
    assert not LlamaConfig(**fields, scan_layers=False).scan_layers


def test_init_params_shapes_and_dtypes() -> None:
    from pallas_flash_llama.config import get_config

    config = get_config("tiny")
    params = model.init_params(config, jax.random.key(0))
    shapes = jax.tree.map(lambda x: x.shape, params)
    assert shapes == model.param_shapes(config)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    assert sum(x.size for x in jax.tree.leaves(params)) == config.num_params


def test_segment_positions() -> None:
    segments = jnp.array([[1, 1, 2, 2, 2, 0, 0]])
    assert model.segment_positions(segments).tolist() == [[0, 1, 0, 1, 2, 0, 1]]
