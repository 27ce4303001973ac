"""Tolerances and the comparison every parity test uses."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

FORWARD_TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}
"""Absolute and relative tolerance of outputs against the float64 reference."""

LARGE_LOGIT_TOLERANCE = {"float32": 5e-4, "bfloat16": 2e-2}
"""Tolerance when q is scaled by 100 (logits of magnitude ~1e3): float32 rounds such a logit by
up to ~1e3 * 2**-24 = 6e-5 before the softmax, and the output inherits that error times |v|.
bfloat16 keeps its usual tolerance: its error comes from rounding probabilities and outputs."""

GRADIENT_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}
"""Tolerance of dq, dk, dv, relative to the largest reference gradient (at least 1)."""


def assert_close(
    actual: object, expected: np.ndarray, tolerance: float, *, name: str = "output"
) -> None:
    """Asserts a finite ``actual`` within ``tolerance`` (absolute and relative) of ``expected``."""
    actual = np.asarray(jnp.asarray(actual, dtype=jnp.float32), dtype=np.float64)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    assert np.isfinite(actual).all(), f"{name}: has inf or NaN"
    np.testing.assert_allclose(actual, expected, atol=tolerance, rtol=tolerance, err_msg=name)


def assert_gradient_close(actual: object, expected: np.ndarray, dtype: str, *, name: str) -> None:
    """Gradient check: the tolerance scales with the largest reference magnitude (at least 1)."""
    scale = max(1.0, float(np.abs(expected).max()))
    assert_close(actual, expected, GRADIENT_TOLERANCE[dtype] * scale, name=name)
