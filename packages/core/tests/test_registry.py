"""Tests of backend discovery, registration and per-call selection.

Every test runs against a fresh registry installed as the global one (see conftest.py), so
the results do not depend on which backend distributions are installed.
"""

from __future__ import annotations

import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_flash as pf
from pallas_flash.hookspecs import ENTRY_POINT_GROUP
from pallas_flash.registry import BACKEND_ENV_VAR, Registry

OTHER_PLATFORM = "no-such-platform"
"""A platform name that is never ``jax.default_backend()``."""

Q = jnp.ones((1, 2, 3, 4), jnp.float32)

GOOD_PLUGIN_SOURCE = """
import jax.numpy as jnp

import pallas_flash as pf


class EntryPointBackend(pf.Backend):
    name = "toy"
    capabilities = ("attention",)
    platforms = ("cpu", "gpu", "tpu")

    def attention(self, q, k, v, spec, **kwargs):
        return jnp.full_like(q, 7.0)


@pf.hookimpl
def pallas_flash_backends():
    return [EntryPointBackend()]
"""


def _names() -> list[str]:
    return [info.name for info in pf.list_backends()]


def _uses(backend, call) -> bool:
    """Whether ``call()`` ran ``backend`` (a ToyBackend) once."""
    before = len(backend.calls)
    call()
    return len(backend.calls) == before + 1


@pytest.fixture
def write_distribution(tmp_path, monkeypatch):
    """Writes an installed-looking distribution into tmp_path: a ``.dist-info`` folder whose
    ``entry_points.txt`` declares backend plugins, and the plugin modules; then puts tmp_path
    on sys.path so that importlib.metadata finds it."""
    written_modules: list[str] = []

    def write(name: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
        info = tmp_path / f"{name.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        lines = [f"[{ENTRY_POINT_GROUP}]"] + [f"{n} = {t}" for n, t in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for module, source in modules.items():
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
            written_modules.append(module)
        monkeypatch.syspath_prepend(str(tmp_path))

    yield write
    for module in written_modules:
        sys.modules.pop(module, None)


# --- discovery through entry points ----------------------------------------------------------


def test_entry_point_backend_is_discovered_with_its_distribution(
    fresh_registry, write_distribution
):
    write_distribution(
        "toy-backend",
        {"toy": "pf_test_toy_plugin"},
        {"pf_test_toy_plugin": GOOD_PLUGIN_SOURCE},
    )
    infos = {info.name: info for info in pf.list_backends()}

    assert infos["toy"].distribution == "toy-backend"
    assert infos["toy"].capabilities == frozenset({pf.Capability.ATTENTION})
    assert infos["toy"].platforms == frozenset({"cpu", "gpu", "tpu"})
    assert type(pf.get_backend("toy")).__name__ == "EntryPointBackend"
    out = pf.attention(Q, Q, Q, backend="toy")
    np.testing.assert_array_equal(out, np.full(Q.shape, 7.0))


def test_entry_points_are_loaded_lazily_on_first_use(fresh_registry, write_distribution):
    # The registry exists before the distribution is installed; discovery waits for first use.
    write_distribution(
        "toy-backend",
        {"toy": "pf_test_lazy_plugin"},
        {"pf_test_lazy_plugin": GOOD_PLUGIN_SOURCE},
    )
    assert "pf_test_lazy_plugin" not in sys.modules
    assert "toy" in _names()
    assert "pf_test_lazy_plugin" in sys.modules


def test_entry_point_module_registered_at_runtime_first_is_listed_once(
    fresh_registry, write_distribution
):
    write_distribution(
        "toy-backend",
        {"toy": "pf_test_twice_plugin"},
        {"pf_test_twice_plugin": GOOD_PLUGIN_SOURCE},
    )
    import pf_test_twice_plugin

    pf.register_plugin(pf_test_twice_plugin)
    infos = {info.name: info for info in pf.list_backends()}

    assert infos["toy"].distribution == "toy-backend"
    pf.unregister_plugin(pf_test_twice_plugin)


def test_plugin_that_fails_to_import_is_skipped_with_a_warning(fresh_registry, write_distribution):
    write_distribution(
        "toy-backend",
        {"broken": "pf_test_broken_plugin", "toy": "pf_test_good_plugin"},
        {
            "pf_test_broken_plugin": "raise ImportError('libkernel.so not found')\n",
            "pf_test_good_plugin": GOOD_PLUGIN_SOURCE,
        },
    )
    with pytest.warns(RuntimeWarning, match="skipping backend plugin 'broken'") as record:
        names = _names()

    message = next(str(w.message) for w in record if "'broken'" in str(w.message))
    assert "pf_test_broken_plugin" in message
    assert "libkernel.so not found" in message
    assert "toy" in names
    np.testing.assert_array_equal(pf.attention(Q, Q, Q, backend="toy"), np.full(Q.shape, 7.0))


def test_plugin_whose_hook_raises_is_skipped_with_a_warning(registry, make_backend, install):
    class ExplodingPlugin:
        @pf.hookimpl
        def pallas_flash_backends(self):
            raise RuntimeError("boom")

    exploding = ExplodingPlugin()
    pf.register_plugin(exploding, name="exploding")
    try:
        install(make_backend("fine"))
        with pytest.warns(RuntimeWarning, match=r"skipping backend plugin 'exploding'.*boom"):
            names = _names()
        assert names == ["fine"]
        assert pf.get_backend("fine").name == "fine"
    finally:
        pf.unregister_plugin(exploding)


def test_backend_with_unknown_capability_is_skipped_with_a_warning(registry, make_backend, install):
    install(make_backend("odd", {"attention", "telepathy"}), make_backend("fine"))

    with pytest.warns(RuntimeWarning, match=r"skipping backend ToyBackend\('odd'\).*telepathy"):
        names = _names()

    assert names == ["fine"]
    with pytest.raises(pf.BackendNotFoundError):
        pf.get_backend("odd")


def test_backend_without_a_name_is_skipped_with_a_warning(registry, make_backend, install):
    install(make_backend(""), make_backend("fine"))

    with pytest.warns(RuntimeWarning, match="with no name"):
        names = _names()

    assert names == ["fine"]


def test_duplicate_backend_name_warns_and_keeps_the_first(registry, make_backend, install):
    first, second = make_backend("dup"), make_backend("dup")
    install(first)
    install(second)

    with pytest.warns(RuntimeWarning, match="backend name 'dup'.*keeping the first"):
        backend = pf.get_backend("dup")

    assert backend is first
    assert _names() == ["dup"]


# --- get_backend ---------------------------------------------------------------------------


def test_get_backend_unknown_name_lists_installed_backends(registry, make_backend, install):
    install(make_backend("beta"), make_backend("alpha"))

    with pytest.raises(pf.BackendNotFoundError) as info:
        pf.get_backend("nope")

    assert isinstance(info.value, LookupError)
    message = str(info.value)
    assert "'nope'" in message
    assert "installed backends: alpha, beta" in message
    assert "pip install" not in message


def test_get_backend_of_a_known_first_party_backend_says_what_to_install(registry):
    with pytest.raises(pf.BackendNotFoundError, match="no backend is installed") as info:
        pf.get_backend("pallas")

    assert "pip install pallas-flash-pallas" in str(info.value)


def test_get_backend_returns_the_registered_instance(registry, make_backend, install):
    backend = make_backend("mine")
    install(backend)

    assert pf.get_backend("mine") is backend


# --- selection -----------------------------------------------------------------------------


def test_explicit_name_beats_environment_variable_beats_automatic(
    registry, make_backend, install, monkeypatch
):
    best, from_env, named = (
        make_backend("best", priority=10),
        make_backend("from_env", priority=0),
        make_backend("named", priority=5),
    )
    install(best, from_env, named)

    assert _uses(best, lambda: pf.attention(Q, Q, Q))
    monkeypatch.setenv(BACKEND_ENV_VAR, "from_env")
    assert _uses(from_env, lambda: pf.attention(Q, Q, Q))
    assert _uses(named, lambda: pf.attention(Q, Q, Q, backend="named"))
    monkeypatch.setenv(BACKEND_ENV_VAR, "")  # empty: automatic selection again
    assert _uses(best, lambda: pf.attention(Q, Q, Q))


def test_automatic_selection_skips_a_higher_priority_backend_lacking_a_feature(
    registry, make_backend, install
):
    every = frozenset(pf.Capability)
    fast = make_backend("fast", every - {pf.Capability.SOFTCAP}, priority=10)
    capped = make_backend("capped", every, priority=1)
    install(fast, capped)

    assert _uses(capped, lambda: pf.attention(Q, Q, Q, softcap=20.0))
    assert _uses(fast, lambda: pf.attention(Q, Q, Q))


def test_automatic_selection_only_considers_backends_for_the_current_platform(
    registry, make_backend, install
):
    assert jax.default_backend() != OTHER_PLATFORM
    elsewhere = make_backend("elsewhere", platforms={OTHER_PLATFORM}, priority=100)
    here = make_backend("here", priority=0)
    install(elsewhere, here)

    assert _uses(here, lambda: pf.attention(Q, Q, Q))
    assert _uses(elsewhere, lambda: pf.attention(Q, Q, Q, backend="elsewhere"))


def test_no_backend_for_the_current_platform_is_unsupported(registry, make_backend, install):
    install(make_backend("elsewhere", platforms={OTHER_PLATFORM}))

    with pytest.raises(pf.UnsupportedFeatureError, match=jax.default_backend()) as info:
        pf.attention(Q, Q, Q)

    assert "elsewhere" in str(info.value)


def test_no_backend_installed_raises_backend_not_found(registry):
    with pytest.raises(pf.BackendNotFoundError, match="no backend is installed"):
        pf.attention(Q, Q, Q)
    with pytest.raises(pf.BackendNotFoundError):
        pf.decode(Q[:, :, 0], Q, Q, jnp.array([1]))


def test_no_capable_backend_raises_unsupported_feature(registry, make_backend, install):
    install(
        make_backend("plain", {"attention"}), make_backend("causal_only", {"attention", "causal"})
    )

    with pytest.raises(pf.UnsupportedFeatureError, match="softcap") as info:
        pf.attention(Q, Q, Q, causal=True, softcap=5.0)

    assert "backends on any platform that do: none" in str(info.value)


def test_explicit_backend_lacking_a_feature_names_it_and_the_capable_backends(
    registry, make_backend, install
):
    every = frozenset(pf.Capability)
    install(
        make_backend("plain", every - {pf.Capability.SOFTCAP}),
        make_backend("capped_b", every),
        make_backend("capped_a", every, platforms={OTHER_PLATFORM}),
    )

    with pytest.raises(pf.UnsupportedFeatureError) as info:
        pf.attention(Q, Q, Q, softcap=5.0, backend="plain")

    message = str(info.value)
    assert isinstance(info.value, NotImplementedError)
    assert "backend 'plain' (from the backend argument) does not support softcap" in message
    assert message.endswith("(attention, softcap): capped_a, capped_b")


def test_environment_variable_backend_lacking_a_feature_says_where_it_came_from(
    registry, make_backend, install, monkeypatch
):
    every = frozenset(pf.Capability)
    install(make_backend("plain", every - {pf.Capability.CAUSAL}), make_backend("full", every))
    monkeypatch.setenv(BACKEND_ENV_VAR, "plain")

    with pytest.raises(pf.UnsupportedFeatureError, match="does not support causal") as info:
        pf.attention(Q, Q, Q, causal=True)

    assert f"from the {BACKEND_ENV_VAR} environment variable" in str(info.value)


def test_environment_variable_naming_a_missing_backend_raises(registry, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV_VAR, "splitkv")

    with pytest.raises(pf.BackendNotFoundError, match="pip install pallas-flash-splitkv") as error:
        pf.attention(Q, Q, Q)
    assert "PALLAS_FLASH_BACKEND environment variable" in str(error.value)


def test_string_platforms_are_rejected_with_a_warning(registry, make_backend, install):
    install(make_backend("toy", platforms="cpu"))

    with pytest.warns(RuntimeWarning, match="platforms must be a collection of names"):
        assert "toy" not in _names()


def test_unregistering_an_unknown_plugin_raises_value_error(registry):
    with pytest.raises(ValueError, match="is not a registered pallas_flash plugin"):
        pf.unregister_plugin(object())


# --- registration and listing --------------------------------------------------------------


def test_register_and_unregister_plugin_round_trip(registry, make_backend):
    class Plugin:
        @pf.hookimpl
        def pallas_flash_backends(self):
            return [backend]

    backend = make_backend("roundtrip")
    plugin = Plugin()
    assert _names() == []

    assert pf.register_plugin(plugin, name="my-plugin") == "my-plugin"
    try:
        assert _names() == ["roundtrip"]
        assert pf.get_backend("roundtrip") is backend
    finally:
        pf.unregister_plugin(plugin)

    assert _names() == []
    with pytest.raises(pf.BackendNotFoundError):
        pf.get_backend("roundtrip")


def test_register_plugin_without_a_name_returns_the_generated_name(registry, make_backend):
    class Plugin:
        @pf.hookimpl
        def pallas_flash_backends(self):
            return [make_backend("anon")]

    plugin = Plugin()
    name = pf.register_plugin(plugin)
    try:
        assert isinstance(name, str)
        assert name
        assert _names() == ["anon"]
    finally:
        pf.unregister_plugin(plugin)


def test_list_backends_is_sorted_by_name_with_capability_members(registry, make_backend, install):
    install(
        make_backend("zeta", ["attention", "causal"], platforms=["tpu"], priority=3),
        make_backend("alpha", {pf.Capability.DECODE}),
    )
    install(make_backend("mid", ("attention", pf.Capability.GRAD)))

    infos = pf.list_backends()

    assert [info.name for info in infos] == ["alpha", "mid", "zeta"]
    assert all(isinstance(info, pf.BackendInfo) for info in infos)
    zeta = infos[2]
    assert zeta.capabilities == frozenset({pf.Capability.ATTENTION, pf.Capability.CAUSAL})
    assert all(type(c) is pf.Capability for info in infos for c in info.capabilities)
    assert zeta.platforms == frozenset({"tpu"})
    assert zeta.priority == 3
    assert zeta.distribution is None


def test_registry_records_the_distribution_given_to_register(registry, make_backend):
    # `registry` hides installed entry points from this separate Registry too.
    separate = Registry()
    plugin = ToyPlugin([make_backend("local")])

    assert separate.register(plugin, name="p", distribution="my-dist") == "p"
    assert separate.entries()["local"].info.distribution == "my-dist"
    assert pf.list_backends() == []  # the global registry is a different one

    separate.unregister(plugin)
    assert "local" not in separate.entries()


class ToyPlugin:
    """A plugin object that provides the given backends."""

    def __init__(self, backends):
        self.backends = backends

    @pf.hookimpl
    def pallas_flash_backends(self):
        return self.backends
