"""A program named so that another process can build it: a module-level function by its
import path, the static keyword arguments it takes and the shapes of its array arguments.

The TPU compiler writes its LLO dump only from a process whose libtpu started with the dump
flag, so a program is estimated in a worker process (`pallas_flash_estimate.aot.worker`),
which rebuilds it from a `ProgramRef` sent as JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np


class ArraySpec(NamedTuple):
    """One array argument: its shape, dtype and, for a call over several chips, the axis
    split over them (None: every chip holds all of it)."""

    shape: tuple[int, ...]
    dtype: str
    split_axis: int | None = None


@dataclasses.dataclass(frozen=True)
class ProgramRef:
    """``function(*args, **kwargs)``: ``function`` as ``"package.module:name"`` (a dotted
    name for an attribute of an attribute), ``args`` the shapes and dtypes of its array
    arguments, ``kwargs`` static keyword arguments (JSON values: numbers, strings, lists).

    ``loop_trips``: for a Pallas kernel whose grid is sized at run time (a trip count read
    from memory), its name (without the ``.N`` suffix) and how often its loops run,
    outermost first (`kernel_cost.FullGrid`)."""

    function: str
    args: tuple[ArraySpec, ...]
    kwargs: tuple[tuple[str, object], ...] = ()
    loop_trips: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @classmethod
    def of(
        cls, fn: Callable, args: Sequence[object], kwargs: Mapping[str, object] | None = None
    ) -> ProgramRef:
        """The reference to a module-level ``fn`` (a plain or jitted function) with abstract
        ``args`` (anything with ``shape`` and ``dtype``: ``jax.ShapeDtypeStruct``, arrays)."""
        module = getattr(fn, "__module__", None)
        name = getattr(fn, "__qualname__", None)
        if not module or not name or "<" in name or module == "__main__":
            raise ValueError(
                f"fn: expected a function defined at the top level of an importable module "
                f"(the estimate compiles it in another process, which imports it), got {fn!r}"
            )
        specs = []
        for i, arg in enumerate(args):
            if not hasattr(arg, "shape") or not hasattr(arg, "dtype"):
                raise TypeError(
                    f"args[{i}]: expected an abstract array (jax.ShapeDtypeStruct or an array "
                    f"with shape and dtype), got {type(arg).__name__}"
                )
            specs.append(ArraySpec(tuple(int(d) for d in arg.shape), np.dtype(arg.dtype).name))
        ref = cls(f"{module}:{name}", tuple(specs), tuple(sorted((kwargs or {}).items())))
        if ref.function_object() is not _unwrapped(fn):
            raise ValueError(f"fn: {ref.function} does not name {fn!r} when imported")
        return ref

    def function_object(self) -> Callable:
        """The function ``function`` names, imported."""
        module, _, name = self.function.partition(":")
        obj: object = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        return _unwrapped(obj)

    def resolve(self) -> Callable:
        """``function`` with its static ``kwargs`` bound: called with the array arguments."""
        fn = self.function_object()
        return functools.partial(fn, **dict(self.kwargs)) if self.kwargs else fn

    @property
    def label(self) -> str:
        """``name(shapes, key=value)`` for reports."""
        name = self.function.partition(":")[2]
        shapes = ", ".join(f"{np.dtype(a.dtype).name}{list(a.shape)}" for a in self.args)
        options = "".join(f", {k}={v}" for k, v in self.kwargs)
        return f"{name}({shapes}{options})"

    def trips_of(self, kernel: str) -> tuple[int, ...] | None:
        """The given loop trips of the kernel named ``kernel`` (e.g. ``gmm.1``), if any."""
        return dict(self.loop_trips).get(kernel.split(".")[0])

    def to_json(self) -> dict[str, object]:
        return {"function": self.function, "args": [[list(a.shape), a.dtype] for a in self.args],
                "kwargs": dict(self.kwargs),
                "loop_trips": {k: list(v) for k, v in self.loop_trips}}  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> ProgramRef:
        args = tuple(ArraySpec(tuple(shape), dtype) for shape, dtype in data["args"])
        kwargs = tuple(sorted(dict(data.get("kwargs") or {}).items()))
        trips = tuple(sorted((k, tuple(v)) for k, v in dict(data.get("loop_trips") or {}).items()))
        return cls(str(data["function"]), args, kwargs, trips)


def _unwrapped(fn: object) -> object:
    """A jitted function's Python function (``jax.jit`` keeps it as ``__wrapped__``)."""
    return getattr(fn, "__wrapped__", fn)


DTYPE_ALIASES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "s32": "int32",
                 "i32": "int32", "s8": "int8", "i8": "int8", "u8": "uint8"}  # fmt: skip
"""Short dtype names (XLA's) `parse_array` takes too."""

_ARRAY_RE = re.compile(r"^(?P<dtype>\w+)\[(?P<dims>[\d,\s]*)\]$")


def parse_array(text: str) -> ArraySpec:
    """``bfloat16[4096,4096]`` (or ``int32[]`` for a scalar) as an `ArraySpec`."""
    m = _ARRAY_RE.match(text.strip())
    if m is None:
        raise ValueError(
            f"--arg: expected DTYPE[D0,D1,...], e.g. bfloat16[4096,4096]; got {text!r}"
        )
    name = DTYPE_ALIASES.get(m["dtype"], m["dtype"])
    try:
        dtype = np.dtype(name).name
    except TypeError:
        import ml_dtypes  # bfloat16 and the other machine-learning dtypes

        if not hasattr(ml_dtypes, name):
            raise ValueError(f"--arg: unknown dtype {m['dtype']!r} in {text!r}") from None
        dtype = np.dtype(getattr(ml_dtypes, name)).name
    dims = tuple(int(d) for d in m["dims"].split(",") if d.strip())
    return ArraySpec(dims, dtype)
