"""Sampling: the filters' definitions, each row's own parameters, and the engine's sampler
(`sample_rows`) drawing from the very distribution a NumPy reference of vLLM's top-k/top-p
defines, whichever of its paths draws it."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import pallas_flash as pf
from pallas_flash_llama.sampling import (
    PREFILTER,
    Sampling,
    filter_logits,
    filter_rows,
    sample,
    sample_rows,
)

VOCAB = 512
"""Past `PREFILTER`, so that rows can reach beyond the candidates."""


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float):
    """``[vocab]`` float64 probabilities of one row, as vLLM's ``apply_top_k_top_p`` defines
    them (`vllm/v1/sample/ops/topk_topp_sampler.py`): sort ascending, mask below the k-th
    largest, then mask each token whose cumulative mass (it and the less likely) is at most
    ``1 - top_p``, the most likely always kept."""
    x = logits.astype(np.float64) / temperature
    order = np.argsort(x, kind="stable")
    ascending = x[order]
    ascending = np.where(ascending < ascending[-top_k], -np.inf, ascending)
    probs = np.exp(ascending - ascending.max())
    probs /= probs.sum()
    dropped = np.cumsum(probs) <= 1 - top_p
    dropped[-1] = False
    ascending = np.where(dropped, -np.inf, ascending)
    kept = np.exp(ascending - ascending.max())
    out = np.empty_like(kept)
    out[order] = kept / kept.sum()
    return out


def _logits(scale: float, seed: int) -> np.ndarray:
    return (scale * np.random.default_rng(seed).standard_normal(VOCAB)).astype(np.float32)


# each case: logits, temperature, top_k, top_p; named by the sampler's path it takes
CASES = {
    "top-k among the candidates": (_logits(2.0, 0), 0.8, 40, 1.0),
    "top-k and top-p among the candidates": (_logits(2.0, 1), 1.0, 100, 0.8),
    "top-p held by the candidates": (_logits(1.5, 2), 1.0, VOCAB, 0.9),
    "top-p past the candidates": (_logits(0.5, 3), 1.5, VOCAB, 0.99),
    "top-k past the candidates": (_logits(1.0, 4), 1.0, 300, 0.95),
    "no filter": (_logits(1.0, 5), 1.2, VOCAB, 1.0),
}


def _candidate_mass(logits: np.ndarray, temperature: float) -> float:
    p = np.exp(logits.astype(np.float64) / temperature)
    return float(np.sort(p / p.sum())[-PREFILTER:].sum())


def test_the_cases_take_each_path() -> None:
    assert 0.9 <= _candidate_mass(*CASES["top-p held by the candidates"][:2]) < 0.95
    assert _candidate_mass(*CASES["top-p past the candidates"][:2]) < 0.99
    assert CASES["top-k past the candidates"][2] > PREFILTER


def test_every_path_draws_the_reference_distribution() -> None:
    """One mixed batch, every case in it: a chi-square test of each case's draws against its
    reference probabilities (fixed seed), and no draw outside what the filters keep."""
    draws_per_case = 6000
    names = list(CASES)
    case = np.arange(len(names) * draws_per_case) % len(names)
    column = lambda i: np.array([CASES[names[c]][i] for c in case])  # noqa: E731
    logits = np.stack([CASES[n][0] for n in names])[case]
    keys = jax.random.split(jax.random.key(7), case.size)
    drawn = np.asarray(
        sample_rows(jnp.asarray(logits), keys, jnp.asarray(column(1), jnp.float32),
                    jnp.asarray(column(2), jnp.int32), jnp.asarray(column(3), jnp.float32))
    )  # fmt: skip
    for c, name in enumerate(names):
        probs = reference_probs(*CASES[name])
        counts = np.bincount(drawn[case == c], minlength=VOCAB)
        assert counts[probs == 0].sum() == 0, f"{name}: drew a token the filters drop"
        expected = probs * draws_per_case
        big = expected >= 5  # the rest pooled into one bin
        observed = np.append(counts[big], counts[~big].sum())
        wanted = np.append(expected[big], expected[~big].sum())
        if wanted[-1] == 0:
            observed, wanted = observed[:-1], wanted[:-1]
        p_value = stats.chisquare(observed, wanted).pvalue
        assert p_value > 1e-4, f"{name}: chi-square p = {p_value:.2e}"


def _primitives(jaxpr, under_cond: bool = False):
    """(primitive name, whether it sits in a ``cond`` branch) for every equation."""
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name, under_cond
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _primitives(sub, under_cond or eqn.primitive.name == "cond")


def test_sorts_sit_only_in_branches_taken_when_needed() -> None:
    """An all-greedy step runs the argmax alone; the vocabulary's sort and the top-k only
    run in a conditional branch."""
    rows = 4
    args = (jax.random.split(jax.random.key(0), rows), jnp.zeros(rows),
            jnp.full(rows, VOCAB, jnp.int32), jnp.ones(rows))  # fmt: skip
    logits = jax.random.normal(jax.random.key(3), (rows, VOCAB))
    found = list(_primitives(jax.make_jaxpr(sample_rows)(logits, *args).jaxpr))
    heavy = [(name, inside) for name, inside in found if name in ("sort", "top_k")]
    assert {name for name, _ in heavy} == {"sort", "top_k"}
    assert all(inside for _, inside in heavy)
    np.testing.assert_array_equal(sample_rows(logits, *args), jnp.argmax(logits, axis=-1))


def test_sampling_filters() -> None:
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda s: np.isfinite(np.asarray(filter_logits(logits, s)))[0].tolist()  # noqa: E731
    assert kept(Sampling(1.0, top_k=2)) == [True, True, False, False]
    assert kept(Sampling(1.0, top_p=0.7)) == [True, True, False, False]
    assert kept(Sampling(1.0, top_p=0.9)) == [True, True, True, False]
    assert kept(Sampling(1.0, top_p=0.1)) == [True, False, False, False]
    key = jax.random.key(0)
    assert sample(logits, key, Sampling()).tolist() == [0]
    draws = [int(sample(logits, k, Sampling(1.0, top_k=2))[0]) for k in jax.random.split(key, 64)]
    assert set(draws) == {0, 1}


def test_sampling_filters_per_row_are_each_row_s_own() -> None:
    logits = jax.random.normal(jax.random.key(1), (4, 64))
    rows = [Sampling(0.7, top_k=5), Sampling(1.0, top_p=0.5), Sampling(2.0, 3, 0.9), Sampling(1.0)]
    filtered = filter_rows(logits, jnp.array([s.temperature for s in rows]),
                           jnp.array([s.top_k or 64 for s in rows]),
                           jnp.array([s.top_p or 1.0 for s in rows]))  # fmt: skip
    for i, s in enumerate(rows):
        np.testing.assert_array_equal(filtered[i], filter_logits(logits[i : i + 1], s)[0])
    keys = jax.random.split(jax.random.key(2), 4)
    temperature = jnp.array([0.0, 1.0, 0.0, 1.0])
    drawn = sample_rows(logits, keys, temperature, jnp.full(4, 64), jnp.ones(4))
    assert drawn[0] == jnp.argmax(logits[0]) and drawn[2] == jnp.argmax(logits[2])
    assert drawn[1] == jax.random.categorical(keys[1], logits[1])


@pytest.mark.parametrize(
    "kwargs, message",
    [({"temperature": -1.0}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_p": 0.0}, "top_p")],
)
def test_bad_sampling_is_named(kwargs, message) -> None:
    with pytest.raises(pf.InvalidInputError, match=message):
        Sampling(**kwargs)
