"""Training data: documents from a text or jsonl file, tokenised and packed into rows.

Packing concatenates documents into rows of ``seq_len`` tokens; each document (or piece of
one split across rows) gets its own segment id in its row, so attention and the loss never
cross documents; the rest of the last row is padding (token 0, segment 0).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator, Sequence

import numpy as np

import pallas_flash as pf


def read_documents(path: str | pathlib.Path) -> list[str]:
    """The documents of ``path``: for ``.jsonl``, each line's ``"text"``; otherwise each
    non-empty line of the text file.

    Raises:
      pf.InvalidInputError: the file is missing or empty, or a jsonl line has no "text".
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise pf.InvalidInputError(f"data: no such file {path}")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        docs = []
        for number, line in enumerate(lines, start=1):
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise pf.InvalidInputError(
                    f"data: {path} line {number}: expected an object with a string 'text'"
                )
            docs.append(record["text"])
        lines = docs
    if not lines:
        raise pf.InvalidInputError(f"data: {path} holds no documents")
    return lines


def pack(documents: Sequence[Sequence[int]], seq_len: int) -> dict[str, np.ndarray]:
    """Packs tokenised documents into ``tokens`` and ``segment_ids``, both
    ``[rows, seq_len]`` int32 (see the module doc)."""
    if seq_len < 2:
        raise pf.InvalidInputError(f"seq_len: expected >= 2, got {seq_len}")
    rows_tokens: list[list[int]] = [[]]
    rows_segments: list[list[int]] = [[]]
    for doc in documents:
        doc = list(doc)
        while doc:
            room = seq_len - len(rows_tokens[-1])
            if room == 0:
                rows_tokens.append([])
                rows_segments.append([])
                room = seq_len
            piece, doc = doc[:room], doc[room:]
            segment = (rows_segments[-1][-1] + 1) if rows_segments[-1] else 1
            rows_tokens[-1] += piece
            rows_segments[-1] += [segment] * len(piece)
    tokens = np.zeros((len(rows_tokens), seq_len), np.int32)
    segments = np.zeros_like(tokens)
    for i, (row, seg) in enumerate(zip(rows_tokens, rows_segments, strict=True)):
        tokens[i, : len(row)] = row
        segments[i, : len(seg)] = seg
    return {"tokens": tokens, "segment_ids": segments}


def batches(
    packed: dict[str, np.ndarray], batch_size: int, seed: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches of ``batch_size`` rows, reshuffled every pass over the data (rows are
    repeated when there are fewer than ``batch_size``)."""
    rows = packed["tokens"].shape[0]
    rng = np.random.default_rng(seed)
    order = np.empty(0, np.int64)
    while True:
        while order.size < batch_size:
            order = np.concatenate([order, rng.permutation(rows)])
        take, order = order[:batch_size], order[batch_size:]
        yield {name: array[take] for name, array in packed.items()}
