"""How context parallelism attends to a pair of sequence chunks under the call's mask.

A query chunk ``a`` and a key chunk ``b``, ``chunk`` tokens each (indices along the
sequence), lie ``distance = a - b`` chunks apart: the key at row ``j`` of its chunk sits
``distance x chunk + i - j`` tokens before the query at row ``i`` of its own. Under a causal
mask or a sliding window the pair is therefore one of three kinds, fixed by the distance:
no key visible (skipped, weight 0), every key visible (attended without a mask), or cut by
the mask (attended with the call's spec at ``q_offset = distance x chunk``, which places the
mask as on the whole sequence). `ChunkPairs` lists the kinds a call meets, in the order of a
``lax.switch``'s branches, and maps a pair to its branch; a causal mask alone gives
`pallas_flash.context_layout.PAIR_KINDS`: skipped, the diagonal, unmasked.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_flash.specs import AttentionSpec


@dataclasses.dataclass(frozen=True)
class ChunkPairs:
    """The branches a call's pairs of chunks take (a spec each; None: skipped) and, for each
    distance from ``-(chunks - 1)`` to ``chunks - 1``, its branch."""

    branches: tuple[AttentionSpec | None, ...]
    branch_of_distance: tuple[int, ...]

    @classmethod
    def of(cls, spec: AttentionSpec, chunk: int, chunks: int) -> ChunkPairs:
        """The pairs of a sequence of ``chunks`` chunks of ``chunk`` tokens under ``spec``
        (its ``q_offset`` is replaced: the sequence is self-attention)."""
        left, right = spec.window if spec.window is not None else (math.inf, math.inf)
        right = 0 if spec.causal else right
        full = dataclasses.replace(spec, causal=False, window=None, q_offset=0)
        kinds = {}
        for distance in range(-(chunks - 1), chunks):
            offset = distance * chunk  # the first query's position in the key chunk
            if offset + chunk - 1 + right < 0 or offset - left > chunk - 1:
                kinds[distance] = None  # every key after the last query's or before the window
            elif offset + chunk - 1 - left <= 0 and offset + right >= chunk - 1:
                kinds[distance] = full
            else:
                kinds[distance] = dataclasses.replace(spec, q_offset=offset)
        masked = [kinds[d] for d in sorted(kinds) if kinds[d] not in (None, full)]
        used = set(kinds.values())
        branches = tuple(s for s in (None, *masked, full) if s in used)  # skipped first
        index = {s: i for i, s in enumerate(branches)}
        return cls(branches, tuple(index[kinds[d]] for d in sorted(kinds)))

    def branch(self, q_chunk: jax.Array, k_chunk: jax.Array) -> jax.Array:
        """The branch of the pair of chunks ``q_chunk`` and ``k_chunk`` (traced indices)."""
        chunks = (len(self.branch_of_distance) + 1) // 2
        table = jnp.asarray(self.branch_of_distance, jnp.int32)
        return table[jnp.asarray(q_chunk) - jnp.asarray(k_chunk) + chunks - 1]
