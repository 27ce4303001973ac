"""int8 weights (`int8_weights`): the quantization's error bound, the matmul against the
dequantized weight, the tiny model's logits and a trained model's greedy tokens against the
unquantized model, and the engine serving them on one device and tensor-parallel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash_llama import data, model
from pallas_flash_llama.config import get_config
from pallas_flash_llama.engine import Engine
from pallas_flash_llama.int8_weights import INPUT_AXES, Int8Weight, dot, quantize, quantize_params
from pallas_flash_llama.scheduler import Request
from pallas_flash_llama.sharding import make_mesh, param_shardings
from pallas_flash_llama.train import TrainConfig, init_state, make_train_step

LOGIT_BOUND = 0.05
"""int8 weights move the tiny model's logits by at most this share of their largest."""


def _dequantized(q: Int8Weight, leading: int, inputs: int) -> np.ndarray:
    scales = np.expand_dims(np.asarray(q.scales), tuple(range(leading, leading + inputs)))
    return np.asarray(q.values, np.float64) * scales


def test_each_value_is_within_half_a_step_of_the_weight() -> None:
    w = jax.random.normal(jax.random.key(0), (3, 16, 4, 8)).at[1, :, 2, 5].set(0.0)
    q = quantize(w, leading=1, inputs=1)
    assert q.values.dtype == jnp.int8 and q.scales.shape == (3, 4, 8)
    error = np.abs(_dequantized(q, 1, 1) - np.asarray(w))
    assert (error <= np.asarray(q.scales)[:, None] / 2 + 1e-7).all()
    assert (np.abs(np.asarray(q.values)).max(axis=1) == 127).sum() == 3 * 4 * 8 - 1
    assert not _dequantized(q, 1, 1)[1, :, 2, 5].any(), "an all-zero channel stays zero"


@pytest.mark.parametrize(
    "spec, x_shape, w_shape, inputs",
    [("bsd,dhk->bhsk", (2, 5, 16), (16, 4, 8), 1), ("bhsk,hkd->bsd", (2, 4, 5, 8), (4, 8, 16), 2),
     ("...d,dv->...v", (3, 16), (16, 24), 1)],
)  # fmt: skip
def test_the_matmul_is_int8_tokens_times_the_dequantized_weight(spec, x_shape, w_shape,
                                                                 inputs) -> None:  # fmt: skip
    """Against NumPy in float64: each token's activations rounded to ``max |x| / 127`` steps
    over the contracted axes, times the dequantized weight."""
    x = jax.random.normal(jax.random.key(1), x_shape)
    q = quantize(jax.random.normal(jax.random.key(2), w_shape), leading=0, inputs=inputs)
    x64 = np.asarray(x, np.float64)
    contracted = (1, 3) if inputs == 2 else (x64.ndim - 1,)
    step = np.abs(x64).max(axis=contracted, keepdims=True) / 127
    expected = np.einsum(spec, np.round(x64 / step) * step, _dequantized(q, 0, inputs))
    np.testing.assert_allclose(dot(spec, x, q), expected, rtol=1e-5, atol=1e-5)


def test_the_tiny_model_s_logits_move_within_the_bound() -> None:
    config = get_config("tiny").replace(dtype="float32")
    params = model.init_params(config, jax.random.key(0))
    quantized = quantize_params(params)
    assert isinstance(quantized["layers"]["wq"], Int8Weight)
    assert quantized["embed"].dtype == params["embed"].dtype, "the lookup is not quantized"
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 3, config.vocab)
    ours = np.asarray(model.forward(quantized, tokens, config, backend="xla"))
    full = np.asarray(model.forward(params, tokens, config, backend="xla"))
    assert np.abs(ours - full).max() <= LOGIT_BOUND * np.abs(full).max()


def _trained(config, steps: int = 40):
    """The tiny model trained on a learnable pattern (each token the one before plus a
    document's stride), and held-out documents of it."""
    rng = np.random.default_rng(0)

    def document():
        start, stride = rng.integers(3, 200), rng.integers(1, 5)
        return [int(3 + (start + stride * i) % 250) for i in range(32)]

    batches = data.batches(data.pack([document() for _ in range(64)], seq_len=32), 8)
    train_config = TrainConfig(learning_rate=3e-3, warmup_steps=4, total_steps=steps)
    state = init_state(model.init_params(config, jax.random.key(0)), train_config)
    step = make_train_step(config, train_config, backend="xla")
    for _ in range(steps):
        state, _ = step(state, jax.device_put(next(batches)))
    return state.params, np.array([document() for _ in range(8)])


def test_a_trained_model_s_greedy_tokens_mostly_agree(capsys) -> None:
    """Teacher-forced greedy steps (the next token at every position of held-out documents)
    of the trained tiny model in bfloat16, its weights int8 and not."""
    config = get_config("tiny")
    params, held_out = _trained(config)
    full = model.forward(params, held_out, config, backend="xla").argmax(-1)
    ours = model.forward(quantize_params(params), held_out, config, backend="xla").argmax(-1)
    agree = float((np.asarray(full) == np.asarray(ours)).mean())
    with capsys.disabled():
        print(f"\nint8 weights: greedy steps agreeing with bfloat16: {agree:.1%}")
    assert agree >= 0.9


def test_training_int8_weights_is_refused() -> None:
    params = quantize_params(model.init_params(get_config("tiny"), jax.random.key(0)))
    with pytest.raises(pf.UnsupportedFeatureError, match=r"params: int8 weights .* inference"):
        init_state(params, TrainConfig())


def test_the_engine_serves_int8_weights_alone_batched_and_tensor_parallel() -> None:
    config = get_config("tiny").replace(dtype="float32")
    params = model.init_params(config, jax.random.key(0))
    sizes = dict(slots=3, token_budget=8, page_size=4, num_pages=24, pages_per_sequence=8)
    rng = np.random.default_rng(5)
    requests = [Request(f"r{i}", tuple(int(t) for t in rng.integers(3, 500, 6 + i)), 6)
                for i in range(4)]  # fmt: skip
    one = Engine(quantize_params(params), config, backend="xla", **sizes)
    alone = {r.id: one.run_all([r])[r.id].tokens for r in requests}
    assert {i: f.tokens for i, f in one.run_all(requests).items()} == alone
    mesh = make_mesh(1, 1, 2, devices=jax.devices()[:2])
    placed = quantize_params(jax.device_put(params, param_shardings(config, mesh)), mesh, config)
    assert placed["layers"]["wq"].scales.sharding.spec[-2] == "tensor"  # q heads split
    served = Engine(placed, config, backend="xla", mesh=mesh, **sizes)
    assert {i: f.tokens for i, f in served.run_all(requests).items()} == alone
    assert set(INPUT_AXES) >= {"wq", "wo", "w_down"}
