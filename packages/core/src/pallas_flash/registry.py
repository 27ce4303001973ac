"""Finding installed backends and choosing one per call.

Backends are pluggy plugins. Installing a distribution that declares an entry point in the
group ``pallas_flash.backends`` is all it takes to make its backends selectable by name; a
plugin can also be registered at runtime with `register_plugin`. Plugins are loaded
lazily, on the first call that needs a backend; one that fails to import is skipped with a
warning so the others keep working.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import warnings
from collections.abc import Iterable

import jax
import pluggy

from pallas_flash import hookspecs
from pallas_flash.backend import Backend, BackendInfo
from pallas_flash.capabilities import Capability, as_capabilities
from pallas_flash.errors import BackendNotFoundError, UnsupportedFeatureError

BACKEND_ENV_VAR = "PALLAS_FLASH_BACKEND"

KNOWN_DISTRIBUTIONS = {
    "xla": "pallas-flash-xla",
    "pallas": "pallas-flash-pallas",
    "splitkv": "pallas-flash-splitkv",
}
"""First-party backends and the distribution that provides each, for error messages."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    backend: Backend
    info: BackendInfo


class Registry:
    """The plugin manager and the backends its plugins provide."""

    def __init__(self) -> None:
        self._plugins = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._plugins.add_hookspecs(hookspecs)
        self._distributions: dict[str, str | None] = {}
        self._discovered = False
        self._entries: dict[str, _Entry] | None = None

    def register(
        self, plugin: object, *, name: str | None = None, distribution: str | None = None
    ) -> str:
        """Registers a plugin; returns the name pluggy registered it under."""
        plugin_name = self._plugins.register(plugin, name=name)
        if plugin_name is None:
            raise ValueError(f"plugin {name or plugin!r} is blocked")
        self._distributions[plugin_name] = distribution
        self._entries = None
        return plugin_name

    def unregister(self, plugin: object) -> None:
        """Removes a plugin registered with `register`."""
        if not self._plugins.is_registered(plugin):
            raise ValueError(f"{plugin!r} is not a registered pallas_flash plugin")
        self._plugins.unregister(plugin)
        self._entries = None

    def _discover(self) -> None:
        if self._discovered:
            return
        self._discovered = True
        for entry_point in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
            if self._plugins.has_plugin(entry_point.name):
                continue
            try:
                plugin = entry_point.load()
            except Exception as exc:  # noqa: BLE001 - any import failure must not break others
                warnings.warn(
                    f"pallas_flash: skipping backend plugin {entry_point.name!r} "
                    f"({entry_point.value}): it failed to import: {exc!r}",
                    RuntimeWarning,
                    stacklevel=3,
                )
                continue
            dist = entry_point.dist.name if entry_point.dist is not None else None
            if self._plugins.is_registered(plugin):  # already registered at runtime
                self._distributions[self._plugins.get_name(plugin)] = dist
                continue
            try:
                self.register(plugin, name=entry_point.name, distribution=dist)
            except ValueError as exc:
                warnings.warn(
                    f"pallas_flash: skipping backend plugin {entry_point.name!r}: {exc}",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def entries(self) -> dict[str, _Entry]:
        """All registered backends by name, loading entry points on first use."""
        self._discover()
        if self._entries is None:
            self._entries = {}
            for impl in self._plugins.hook.pallas_flash_backends.get_hookimpls():
                for backend in self._call_plugin(impl):
                    self._add(backend, self._distributions.get(impl.plugin_name))
        return self._entries

    @staticmethod
    def _call_plugin(impl: pluggy.HookImpl) -> Iterable[Backend]:
        try:
            return list(impl.function())
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the others
            warnings.warn(
                f"pallas_flash: skipping backend plugin {impl.plugin_name!r}: "
                f"pallas_flash_backends() raised {exc!r}",
                RuntimeWarning,
                stacklevel=4,
            )
            return []

    def _add(self, backend: Backend, distribution: str | None) -> None:
        assert self._entries is not None
        try:
            for field in ("capabilities", "platforms"):
                if isinstance(getattr(backend, field), str):
                    raise TypeError(f"{field} must be a collection of names, not a string")
            info = BackendInfo(
                name=backend.name,
                capabilities=as_capabilities(backend.capabilities),
                platforms=frozenset(backend.platforms),
                priority=int(backend.priority),
                distribution=distribution,
            )
        except (TypeError, ValueError) as exc:
            warnings.warn(
                f"pallas_flash: skipping backend {backend!r}: {exc}", RuntimeWarning, stacklevel=5
            )
            return
        if not info.name:
            warnings.warn(
                f"pallas_flash: skipping backend {backend!r} with no name",
                RuntimeWarning,
                stacklevel=5,
            )
        elif info.name in self._entries:
            other = self._entries[info.name].info.distribution
            warnings.warn(
                f"pallas_flash: backend name {info.name!r} from {distribution or 'a plugin'} is "
                f"already taken by {other or 'a plugin registered earlier'}; keeping the first",
                RuntimeWarning,
                stacklevel=5,
            )
        else:
            self._entries[info.name] = _Entry(backend, info)


_REGISTRY = Registry()


def register_plugin(plugin: object, *, name: str | None = None) -> str:
    """Registers a backend plugin at runtime (a module or object with a ``pallas_flash_backends``
    hook implementation); returns its plugin name."""
    return _REGISTRY.register(plugin, name=name)


def unregister_plugin(plugin: object) -> None:
    """Removes a plugin registered with `register_plugin`."""
    _REGISTRY.unregister(plugin)


def list_backends() -> list[BackendInfo]:
    """The installed backends, sorted by name."""
    return sorted((e.info for e in _REGISTRY.entries().values()), key=lambda info: info.name)


def _describe_installed() -> str:
    infos = list_backends()
    if not infos:
        return "no backend is installed (pip install pallas-flash-xla for the XLA baseline)"
    return "installed backends: " + ", ".join(
        f"{i.name} ({i.distribution})" if i.distribution else i.name for i in infos
    )


def get_backend(name: str, *, source: str = "backend argument") -> Backend:
    """The installed backend called ``name``.

    Args:
      name: the backend's name.
      source: where the name came from, for the error message.

    Raises:
      BackendNotFoundError: no installed backend has that name; the message lists the
        installed ones and, for a known first-party backend, the distribution to install.
    """
    entries = _REGISTRY.entries()
    if name in entries:
        return entries[name].backend
    message = f"unknown attention backend {name!r} (from the {source}); {_describe_installed()}"
    if name in KNOWN_DISTRIBUTIONS:
        dist = KNOWN_DISTRIBUTIONS[name]
        message += f". {name!r} is provided by {dist}: pip install {dist}"
    raise BackendNotFoundError(message)


def _names_with(features: frozenset[Capability]) -> str:
    names = [i.name for i in list_backends() if features <= i.capabilities]
    return ", ".join(names) if names else "none"


def select_backend(name: str | None, features: frozenset[Capability]) -> Backend:
    """Chooses the backend for one call.

    Args:
      name: an explicit backend name, or None to use the ``PALLAS_FLASH_BACKEND`` environment
        variable, or else the highest-priority installed backend built for the current platform
        (``jax.default_backend()``) that has every feature.
      features: what the call needs.

    Raises:
      BackendNotFoundError: the named backend is not installed, or none is installed at all.
      UnsupportedFeatureError: the chosen backend (or every candidate) lacks a feature.
    """
    source = "backend argument"
    if name is None and os.environ.get(BACKEND_ENV_VAR):
        name, source = os.environ[BACKEND_ENV_VAR], f"{BACKEND_ENV_VAR} environment variable"
    if name is not None:
        backend = get_backend(name, source=source)
        missing = features - _REGISTRY.entries()[name].info.capabilities
        if missing:
            raise UnsupportedFeatureError(
                f"backend {name!r} (from the {source}) does not support "
                f"{', '.join(sorted(missing))}; installed backends that support every feature "
                f"of this call ({', '.join(sorted(features))}): {_names_with(features)}"
            )
        return backend
    platform = jax.default_backend()
    infos = sorted(list_backends(), key=lambda info: -info.priority)
    if not infos:
        raise BackendNotFoundError(_describe_installed())
    for info in infos:
        if platform in info.platforms and features <= info.capabilities:
            return _REGISTRY.entries()[info.name].backend
    raise UnsupportedFeatureError(
        f"no installed backend for platform {platform!r} supports every feature of this call "
        f"({', '.join(sorted(features))}); backends on any platform that do: "
        f"{_names_with(features)}; {_describe_installed()}"
    )
