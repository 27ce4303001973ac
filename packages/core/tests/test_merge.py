"""The log-sum-exp merge of partial results against a softmax over all keys at once."""

from __future__ import annotations

import numpy as np

from pallas_flash.merge import merge


def _partial(scores: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Normalised output and log-sum-exp of ``scores [rows, keys]`` (``-inf``: hidden)."""
    top = scores.max(axis=-1, keepdims=True)
    shift = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(scores - shift)
    total = weights.sum(axis=-1, keepdims=True)
    out = np.divide(
        weights @ values, total, out=np.zeros((len(scores), values.shape[1])), where=total > 0
    )
    with np.errstate(divide="ignore"):
        lse = np.log(total[:, 0]) + shift[:, 0]
    return out, lse


def test_merging_parts_equals_the_whole() -> None:
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((3, 40)) * 5
    scores[1, :25] = -np.inf  # row 1 sees nothing in the first two parts
    scores[2, :] = -np.inf  # row 2 sees nothing at all
    values = rng.standard_normal((40, 8))
    parts = [_partial(scores[:, i : i + 10], values[i : i + 10]) for i in range(0, 40, 10)]
    out = np.stack([p[0] for p in parts], axis=1)  # [rows, parts, head_dim]
    lse = np.stack([p[1] for p in parts], axis=1)
    merged_out, merged_lse = merge(out.astype(np.float32), lse.astype(np.float32), axis=1)
    expected_out, expected_lse = _partial(scores, values)
    np.testing.assert_allclose(merged_out, expected_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(merged_lse[:2], expected_lse[:2], rtol=1e-5)
    assert np.isneginf(merged_lse[2]) and (np.asarray(merged_out[2]) == 0).all()
    assert np.isfinite(np.asarray(merged_out)).all()
