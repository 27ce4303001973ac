"""Whether a Pallas kernel of any backend runs as Mosaic (TPU machine code) or in Pallas's
TPU interpreter.

The choice is made at trace time, in Python: ``lax.platform_dependent`` cannot hold an
interpreted kernel (the interpreter's ordered callbacks break the ``cond`` lowering).

Environment variables:
  ``PALLAS_FLASH_INTERPRET``: ``1`` always interprets, ``0`` always emits Mosaic (needed to
  compile for a TPU ahead of time on a host without one); unset or empty: Mosaic on TPU,
  the interpreter elsewhere.
  ``PALLAS_FLASH_DETECT_RACES``: ``1`` turns on the interpreter's race detector, which
  reports `RACE_REPORT` for every data race it sees: jax 0.10 prints it and goes on (its
  verdict per kernel: `recorded_races`), newer jax raises it.

A kernel that runs inside ``shard_map`` on several devices is interpreted by Pallas's generic
interpreter instead (``interpret=True``): the TPU interpreter makes its simulated devices meet
at ``threading.Barrier``s, which need one host thread per device at once and deadlock on a
host with fewer cores than devices (a 2-core machine with 4 host devices). The generic
interpreter runs the same kernel body, index maps and scalar prefetch as plain XLA ops, without
simulating DMAs or detecting races; the single-device runs of the same kernel cover those.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

INTERPRET_ENV_VAR = "PALLAS_FLASH_INTERPRET"
DETECT_RACES_ENV_VAR = "PALLAS_FLASH_DETECT_RACES"
RACE_REPORT = "RACE DETECTED"
"""What the race detector reports for each race: printed to stdout by jax 0.10, raised (in a
``RuntimeError`` from the interpreter's callback) by newer jax."""


def _flag(name: str) -> bool | None:
    """``True`` for ``1``, ``False`` for ``0``, ``None`` when unset or empty."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0, 1 or unset, got {value!r}")
    return None if value == "" else value == "1"


def detects_races() -> bool:
    """Whether ``PALLAS_FLASH_DETECT_RACES`` turns the interpreter's race detector on."""
    return bool(_flag(DETECT_RACES_ENV_VAR))


@contextlib.contextmanager
def recorded_races() -> Iterator[list[Any]]:
    """Inside the block, the race detector's state of every kernel that Pallas's TPU
    interpreter runs, in order, is appended to the list given: a state's ``races_found`` says
    whether the detector saw a race in that kernel. jax keeps only the last kernel's state
    (each kernel replaces it), and jax 0.10 only prints its report: this is the verdict of
    each kernel, read without capturing output. Reads jax's private interpreter module."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

    states: list[Any] = []
    new_state = interpreter.RaceDetectionState

    def recorded(*args: Any, **kwargs: Any) -> Any:
        states.append(new_state(*args, **kwargs))
        return states[-1]

    interpreter.RaceDetectionState = recorded
    try:
        yield states
    finally:
        interpreter.RaceDetectionState = new_state


def interpret_params(devices: int = 1) -> pltpu.InterpretParams | bool | None:
    """The ``interpret=`` argument of ``pl.pallas_call``: None for Mosaic, else the
    interpreter's settings, or True (the generic interpreter) for a kernel that runs on
    ``devices > 1`` devices at once (see the module doc).

    Raises:
      ValueError: an environment variable holds something other than 0, 1 or nothing.
    """
    interpret = _flag(INTERPRET_ENV_VAR)
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    detect_races = detects_races()
    if not interpret:
        return None
    if devices > 1:
        return True
    return pltpu.InterpretParams(detect_races=detect_races)


INTERPRET_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}
"""XLA options of a top-level call of an interpreted kernel: the interpreter's program compiles
about a third faster without backend optimisation and runs as fast."""


def fold_vmap_into_batch(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(*args)``, whose array arguments and results all lead with a batch axis (an
    argument's may be 1: broadcast, as a bias's), with a batching rule that folds a vmapped
    axis into that batch axis: under ``jax.vmap`` of size ``n`` it runs ``fn`` once on ``[n *
    batch, ...]`` arrays (an argument that is not mapped, or whose batch axis is 1, is
    broadcast first) and splits the results back into ``[n, batch, ...]``.

    A kernel then never sees a batched grid: Pallas's own ``pallas_call`` batching rule adds a
    grid axis that Mosaic handles but the TPU interpreter rejects.
    """
    folded = jax.custom_batching.custom_vmap(fn)

    @folded.def_vmap
    def _rule(axis_size: int, in_batched: Sequence[Any], *args: Any) -> tuple[Any, Any]:
        def batch_size(x: jax.Array, batched: bool) -> int:
            return x.shape[1] if batched else x.shape[0]

        batch = max(jax.tree.leaves(jax.tree.map(batch_size, list(args), list(in_batched))))

        def fold(x: jax.Array, batched: bool) -> jax.Array:
            x = x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            x = jnp.broadcast_to(x, (axis_size, batch, *x.shape[2:]))
            return x.reshape(axis_size * batch, *x.shape[2:])

        outs = folded(*jax.tree.map(fold, list(args), list(in_batched)))  # nested vmaps fold too
        outs = jax.tree.map(lambda y: y.reshape(axis_size, -1, *y.shape[1:]), outs)
        return outs, jax.tree.map(lambda _: True, outs)

    return folded


def jit_kernel(
    fn: Callable[..., Any], static_argnames: Sequence[str], *, fold_vmap: bool = True
) -> Callable[..., Any]:
    """``jax.jit`` of ``fn(*arrays, interpret=..., **static)``, a function that builds a
    ``pallas_call`` whose array arguments and results all lead with the batch axis, with
    ``interpret`` filled in by `interpret_params` at each call.

    The returned function takes a keyword ``devices`` (default 1): how many devices run the
    kernel at once (inside ``shard_map``). A call at the top level (no traced argument) of an
    interpreted kernel compiles with `INTERPRET_COMPILER_OPTIONS`; compiler options are not
    allowed inside another trace. Under ``jax.vmap`` the mapped axis is folded into the batch
    axis (`fold_vmap_into_batch`), on TPU and in the interpreter alike; with ``fold_vmap=False``
    (a kernel whose arguments do not all lead with one batch axis) jax's own batching applies.
    """
    names = (*static_argnames, "interpret")

    def kernel(*args: Any, **static: Any) -> Any:
        bound = functools.partial(fn, **static)
        return fold_vmap_into_batch(bound)(*args) if fold_vmap else bound(*args)

    compiled = jax.jit(kernel, static_argnames=names)
    interpreted = jax.jit(
        kernel, static_argnames=names, compiler_options=INTERPRET_COMPILER_OPTIONS
    )

    @functools.wraps(fn)
    def call(*args: Any, devices: int = 1, **kwargs: Any) -> Any:
        params = interpret_params(devices)
        top_level = not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
        chosen = interpreted if params is not None and top_level else compiled
        return chosen(*args, interpret=params, **kwargs)

    return call
