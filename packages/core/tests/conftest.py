"""Fixtures of the core tests: an isolated backend registry and tiny toy backends.

The tests must not depend on which backend distributions are installed (the dev environment
has pallas-flash-xla, a core-only environment has none), so a test that selects a backend runs
against a fresh `Registry` installed as the global one, holding only the toy backends the test
registers itself.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import pallas_flash as pf
import pallas_flash.registry
from pallas_flash.hookspecs import ENTRY_POINT_GROUP
from pallas_flash.masking import apply_softcap
from pallas_flash.registry import BACKEND_ENV_VAR, Registry


@pytest.fixture
def raises_invalid() -> Callable[[str, str], Any]:
    """``raises_invalid(name, got)``: expects an InvalidInputError whose message starts with
    ``name: expected`` (the core's convention for a bad argument) and contains ``got``."""

    def expect(name: str, got: str) -> Any:
        return pytest.raises(
            pf.InvalidInputError, match=rf"^{re.escape(name)}: expected .*{re.escape(got)}"
        )

    return expect


def dense_attention(q, k, v, spec, **_ignored):
    """Differentiable softmax attention of ``[batch, heads, seq, head_dim]`` arrays.

    Repeats kv heads for GQA and applies the spec's scale and softcap; ignores every mask.
    """
    return _dense_attention(q, k, v, spec)


@functools.partial(jax.jit, static_argnames="spec")
def _dense_attention(q, k, v, spec):
    groups = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)
    scores = apply_softcap(jnp.einsum("bhqd,bhkd->bhqk", q, k) * spec.sm_scale, spec.softcap)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)


def doubled_query(q, k, v, spec, **_ignored):
    """A cheap stand-in for attention that still shows whether the output is passed back."""
    return q * 2


class ToyBackend(pf.Backend):
    """A backend that records every call and computes its output with ``fn``."""

    def __init__(
        self,
        name: str,
        capabilities: Iterable[pf.Capability | str],
        platforms: Iterable[str],
        priority: int,
        fn: Callable[..., jax.Array],
    ) -> None:
        self.name = name
        self.capabilities = capabilities
        self.platforms = platforms
        self.priority = priority
        self.fn = fn
        self.calls: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        return f"ToyBackend({self.name!r})"

    def attention(
        self, q, k, v, spec, *, segment_ids=None, bias=None, mask=None, sinks=None, mesh=None,
        context_layout="contiguous", context_exchange="ring",
    ):  # fmt: skip
        self.calls.append(
            dict(
                q=q,
                k=k,
                v=v,
                spec=spec,
                segment_ids=segment_ids,
                bias=bias,
                mask=mask,
                sinks=sinks,
                mesh=mesh,
                context_layout=context_layout,
                context_exchange=context_exchange,
            )
        )
        return self.fn(q, k, v, spec, segment_ids=segment_ids, bias=bias, mask=mask)

    def decode(self, q, cache, lengths, spec, *, mesh=None):
        self.calls.append(dict(q=q, cache=cache, lengths=lengths, spec=spec, mesh=mesh))
        return q + 1

    def ragged_attention(self, q, cache, query_starts, kv_lengths, spec, *, sinks=None):
        self.calls.append(dict(q=q, cache=cache, query_starts=query_starts,
                               kv_lengths=kv_lengths, spec=spec, sinks=sinks))  # fmt: skip
        return q + 1


class ToyPlugin:
    """A pluggy plugin object that provides the given backends."""

    def __init__(self, backends: Iterable[pf.Backend]) -> None:
        self.backends = list(backends)

    @pf.hookimpl
    def pallas_flash_backends(self) -> list[pf.Backend]:
        return self.backends


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    """A new `Registry` installed as the global one (it discovers real entry points);
    ``PALLAS_FLASH_BACKEND`` is unset."""
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    registry = Registry()
    monkeypatch.setattr(pallas_flash.registry, "_REGISTRY", registry)
    return registry


@pytest.fixture
def registry(fresh_registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Registry:
    """`fresh_registry` with the installed distributions' backend entry points hidden, so it
    holds only the plugins a test registers."""
    real_entry_points = importlib.metadata.entry_points

    def entry_points(**params: Any) -> Any:
        if params.get("group") == ENTRY_POINT_GROUP:
            return importlib.metadata.EntryPoints(())
        return real_entry_points(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    return fresh_registry


@pytest.fixture
def dense() -> Callable[..., jax.Array]:
    """`dense_attention`, for toy backends whose output or gradient must be real attention."""
    return dense_attention


@pytest.fixture
def make_backend() -> Callable[..., ToyBackend]:
    """Makes a `ToyBackend`; by default it has every capability, runs on the current
    platform and returns `doubled_query`."""

    def make(
        name: str = "toy",
        capabilities: Iterable[pf.Capability | str] = frozenset(pf.Capability),
        *,
        platforms: Iterable[str] | None = None,
        priority: int = 0,
        fn: Callable[..., jax.Array] = doubled_query,
    ) -> ToyBackend:
        if platforms is None:
            platforms = {jax.default_backend()}
        return ToyBackend(name, capabilities, platforms, priority, fn)

    return make


@pytest.fixture
def install(registry: Registry) -> Iterator[Callable[..., ToyPlugin]]:
    """Registers a `ToyPlugin` of the given backends with `pf.register_plugin` in the isolated
    `registry`; unregisters it after the test."""
    plugins: list[ToyPlugin] = []

    def install_backends(*backends: pf.Backend, name: str | None = None) -> ToyPlugin:
        plugin = ToyPlugin(backends)
        pf.register_plugin(plugin, name=name)
        plugins.append(plugin)
        return plugin

    yield install_backends
    for plugin in plugins:
        pf.unregister_plugin(plugin)
