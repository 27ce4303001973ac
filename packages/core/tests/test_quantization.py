"""int8 quantization of K/V rows: the error bound, zero rows, extremes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import pallas_flash as pf


def test_round_trip_error_is_at_most_half_a_step_per_row():
    x = np.random.default_rng(0).standard_normal((3, 2, 50, 64)).astype(np.float32)
    x[0, 0, 0, 5] = 300.0  # an outlier costs precision only in its own row
    values, scales = pf.quantize_int8(jnp.asarray(x))
    assert values.dtype == jnp.int8 and scales.dtype == jnp.float32
    assert scales.shape == x.shape[:-1]
    back = np.asarray(pf.dequantize_int8(values, scales, jnp.float32))
    error = np.abs(back - x).max(axis=-1)
    np.testing.assert_array_less(error, np.asarray(scales) * (0.5 + 1e-6))
    assert np.abs(np.asarray(values)).max(axis=-1).min() == 127  # each row uses the full range
    assert error[0, 0, 1] < 0.02  # the outlier's neighbour rows keep their resolution


def test_zero_rows_have_scale_zero_and_come_back_zero():
    values, scales = pf.quantize_int8(jnp.zeros((2, 8), jnp.bfloat16))
    assert (np.asarray(scales) == 0).all() and (np.asarray(values) == 0).all()
    back = pf.dequantize_int8(values, scales, jnp.bfloat16)
    assert back.dtype == jnp.bfloat16 and (np.asarray(back, np.float32) == 0).all()
