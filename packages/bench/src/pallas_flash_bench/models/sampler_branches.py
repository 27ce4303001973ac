"""How often the serving engine's sampler (`pallas_flash_llama.sampling.sample_rows`) takes
each branch of its two conditionals, for an engine step whose slots all sample one way.

The whole-program estimate charges every branch of a conditional each time unless told how
often each runs (`program_loops.BranchShares`). The sampler has two, found in the compiled
step by what their branches hold, not by their order:
- the **outer** one: one branch draws (it sorts something: the candidates of ``lax.top_k``),
  the other computes nothing (a step of greedy slots, whose argmax is outside it);
- the **inner** one, inside the drawing branch: one branch sorts arrays as wide as the
  vocabulary (a slot's filters reach past the candidates), the other does not.

The ways a step's slots sample (`SAMPLINGS`): ``greedy`` (the argmax alone), ``candidates``
(top-k or top-p held by each slot's candidates: the drawing branch, no sort of the
vocabulary) and ``sorted`` (the vocabulary sorted too). The engine rows charge
`ENGINE_SAMPLING`, a chat request's top-p, and give the step under each way beside it.
"""

from __future__ import annotations

from collections.abc import Mapping

from pallas_flash_estimate.evaluate import program_loops
from pallas_flash_estimate.read import hlo

SAMPLINGS = ("greedy", "candidates", "sorted")
ENGINE_SAMPLING = "candidates"


def _sort_width(comps: Mapping[str, hlo.Computation], name: str, nested: bool) -> int:
    """The widest minor dimension a ``sort`` in computation ``name`` (and those it calls;
    through conditionals only when ``nested``) sorts; 0 for none."""
    widest, pending, seen = 0, [name], set()
    while pending:
        comp = comps.get(pending.pop())
        if comp is None or comp.name in seen:
            continue
        seen.add(comp.name)
        for op in comp.ops:
            if op.opcode == "sort":
                widest = max([widest] + [dims[-1] for _, dims, _ in hlo.arrays(op.shape) if dims])
            if op.opcode != "conditional" or nested:
                pending += [callee for callee, _ in program_loops.callees(op)]
    return widest


def branch_shares(
    comps: Mapping[str, hlo.Computation], vocab: int, sampling: str
) -> program_loops.BranchShares:
    """The shares of the sampler's conditionals' branches (module doc) in the parsed step
    ``comps`` of a model with ``vocab`` tokens, every slot sampling as ``sampling`` says; None
    (every branch each time) for any other conditional.

    Raises:
      ValueError: ``sampling`` is not one of `SAMPLINGS`.
    """
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling: expected one of {SAMPLINGS}, got {sampling!r}")

    def shares(op: hlo.HloOp) -> tuple[float, ...] | None:
        branches = program_loops.branches(op)
        if len(branches) != 2:
            return None
        sorts_vocab = [_sort_width(comps, b, nested=False) >= vocab for b in branches]
        if sorts_vocab.count(True) == 1:  # the inner conditional
            return tuple(float(s == (sampling == "sorted")) for s in sorts_vocab)
        draws = [_sort_width(comps, b, nested=True) > 0 for b in branches]
        if draws.count(True) == 1:  # the outer conditional
            return tuple(float(d == (sampling != "greedy")) for d in draws)
        return None

    return shares
