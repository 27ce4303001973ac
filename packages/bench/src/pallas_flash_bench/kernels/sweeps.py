"""The sweeps of `Workload`s a bench run compiles: the quick and default sweeps, the serving
decode batches and the mixed serving steps.
"""

from __future__ import annotations

import dataclasses

from pallas_flash_bench.kernels.workloads import Workload

POWERS_OF_TWO = (1024, 2048, 4096, 8192, 16384, 32768)
"""Attention lengths of the default sweep, forward and forward+backward."""

OTHER_LENGTHS = (1536, 3072, 5120, 6144, 12288, 24576, 100_000)
"""Lengths no power-of-two block divides, forward only: where a kernel's tiling leaves
partial blocks (a cliff a sweep of powers of two never shows)."""


MLA = dict(head_dim=192, v_head_dim=128)
"""DeepSeek's multi-head latent attention head_dims: q and k 192, v 128."""

LLAMA_1B = dict(q_heads=32, kv_heads=8, head_dim=64)
"""Llama-3.2-1B's attention heads: 32 query heads over 8 kv heads of 64."""


def default_sweep(chips: int = 1) -> list[Workload]:
    """Batch 1, 16 heads, head_dim 128, bf16: attention 1k..32k (`POWERS_OF_TWO`), causal and
    not, forward and forward+backward, and forward at `OTHER_LENGTHS`; causal MLA head_dims
    (`MLA`) and head_dim 64 (`LLAMA_1B`) at 4k and 16k, forward and forward+backward; a
    bias at 4k, causal and not,
    forward and forward+backward; decode 1k..128k cached
    tokens, 16/16 and 32/8 heads, on one chip and, given a slice of ``chips`` > 1, from 8k on
    over all of them; the serving decode workloads (`serving_sweep`) and the mixed serving
    steps (`ragged_sweep`, `step_sweep`)."""
    attention = [
        Workload(op, n, causal)
        for op in ("forward", "forward_backward")
        for n in POWERS_OF_TWO
        for causal in (False, True)
    ]
    attention += [Workload("forward", n, causal) for n in OTHER_LENGTHS for causal in (False, True)]
    attention += [
        Workload(op, n, causal=True, **heads)
        for heads in (MLA, LLAMA_1B)
        for op in ("forward", "forward_backward")
        for n in (4096, 16384)
    ]
    attention += [
        Workload(op, 4096, causal, bias=True)
        for op in ("forward", "forward_backward")
        for causal in (False, True)
    ]
    decode = [
        Workload("decode", n, q_heads=q, kv_heads=kv)
        for n in (1024, 8192, 32768, 131072)
        for q, kv in ((16, 16), (32, 8))
    ]
    if chips > 1:
        decode += [
            Workload("decode", n, q_heads=q, kv_heads=kv, chips=chips)
            for n in (8192, 32768, 131072)
            for q, kv in ((16, 16), (32, 8))
        ]
    serving = [w for w in serving_sweep(chips) if w not in decode]
    return list(dict.fromkeys(attention + decode + serving + ragged_sweep() + step_sweep()))


SERVING_LENGTHS = (512, 8192)
"""The ragged lengths of the serving batches: uniform in ``[512, 8192]``, `LENGTHS_SEED`."""

LONG_LENGTHS = (32768, 131072)
"""The ragged lengths of the long-context batch split over a slice."""

LONG_PAGE_SIZE = 1024
"""Pages of the long-context batch: large pages make few steps, each a page read through
block specs (v5e-4, static: int8 0.369 ms with pages of 1024, 0.365 ms with pages of 128
read 4 a step; bfloat16 0.692 and 0.686 ms, its HBM time either way)."""


def serving_sweep(chips: int = 1) -> list[Workload]:
    """Serving decode, 32 query heads over 8 kv heads (Llama-3-8B-like) and over 32 (Llama-2-7B),
    bfloat16 and int8 caches: one sequence of 32k and 128k tokens (contiguous); batches of 32
    and 128 sequences of `SERVING_LENGTHS` tokens, paged (pages of 128) and contiguous; given a
    slice of ``chips`` > 1, a batch of 8 of `LONG_LENGTHS` tokens on one chip and on all,
    contiguous (each chip a slice of positions) and paged (pages of `LONG_PAGE_SIZE`, each
    sequence's pages spread round the chips)."""
    rows = []
    for q_heads, kv_heads in ((32, 8), (32, 32)):
        for cache_dtype in (None, "int8"):
            heads = dict(q_heads=q_heads, kv_heads=kv_heads, cache_dtype=cache_dtype)
            rows += [Workload("decode", n, **heads) for n in (32768, 131072)]
            rows += [
                Workload("decode", SERVING_LENGTHS[1], batch=b, lengths=SERVING_LENGTHS,
                         cache=cache, **heads)
                for b in (32, 128)
                for cache in ("paged", "contiguous")
            ]  # fmt: skip
            if chips > 1 and kv_heads == 8:
                rows += [
                    Workload("decode", LONG_LENGTHS[1], batch=8, lengths=LONG_LENGTHS,
                             chips=n, **cache, **heads)
                    for cache in ({}, {"cache": "paged", "page_size": LONG_PAGE_SIZE})
                    for n in (1, chips)
                ]  # fmt: skip
    return rows


VLLM_PAGE_SIZE = 16
"""vLLM's pages on TPU for a model longer than 8192 tokens (tpu-inference's
``PallasAttentionBackend.get_page_size``; up to 8192, ``next_power_of_2(max_model_len) / 16``
within ``[16, 256]``); the mixed steps' others have pages of 128, as the serving batches'."""

RAGGED_MIXES: dict[str, dict[str, object]] = {
    "vllm-512": dict(batch=64, prefill=(1, 448), prefill_context=1024),
    "vllm-2048": dict(batch=128, prefill=(3, 640)),
    "jetstream": dict(batch=96, prefill=(1, 512)),
    "decode": dict(batch=128),
}
"""The mixed steps: vLLM's default token budgets on TPU, 512 (one chunk of 448 of a longer
prompt, 1024 tokens already cached, beside 64 decodes) and 2048 (three prompts' first chunks
beside 128 decodes: prefill-heavy); JetStream-like, a decode batch of 96 beside one prompt of
512; and a decode-only step of 128 sequences. The decoding sequences' lengths are
`SERVING_LENGTHS`."""

MIXED_STEPS = ("vllm-512", "vllm-2048", "jetstream")
"""The mixes that prefill beside their decodes (`ragged_sweep`'s)."""


def serving_step(mix: str, q_heads: int = 32, kv_heads: int = 8, page_size: int = 128) -> Workload:
    """One mixed serving step (`RAGGED_MIXES`), bfloat16, its decoding sequences of
    `SERVING_LENGTHS`, every sequence's capacity the longest of them."""
    return Workload("ragged", SERVING_LENGTHS[1], q_heads=q_heads, kv_heads=kv_heads,
                    lengths=SERVING_LENGTHS, cache="paged", page_size=page_size,
                    **RAGGED_MIXES[mix])  # fmt: skip


def ragged_sweep() -> list[Workload]:
    """The mixed serving steps of ``pf.ragged_attention`` (`serving_step`): every mix of
    `MIXED_STEPS` at 32 query heads over 8 kv heads (Llama-3-8B) and over 32 (Llama-2-7B),
    pages of 128; and vLLM's 512-token step with its own pages (`VLLM_PAGE_SIZE`) at 32/8."""
    steps = [serving_step(mix, 32, kv) for kv in (8, 32) for mix in MIXED_STEPS]
    return [*steps, serving_step("vllm-512", page_size=VLLM_PAGE_SIZE)]


STEP_KV_HEADS = (1, 2, 4, 8)
"""kv heads a chip of the serving-step matrix (`step_sweep`): Llama-3-8B's 8 kv heads, 4 query
heads each, tensor-parallel over 8, 4, 2 and 1 chips."""

STEP_PAGE_SIZES = (16, 64, 128)
"""Pages of the serving-step matrix: vLLM's on TPU for long models (`VLLM_PAGE_SIZE`), and
larger pages fewer copies."""

STEP_MIXES = ("decode", "vllm-512", "vllm-2048")
"""Mixes of the serving-step matrix (`RAGGED_MIXES`): decode-only, vLLM's 512-token step and
its prefill-heavy 2048-token step."""


def step_sweep() -> list[Workload]:
    """The serving-step matrix: every mix of `STEP_MIXES` at one chip's share of Llama-3-8B's
    heads (`STEP_KV_HEADS`) and every page size (`STEP_PAGE_SIZES`). At 8 kv heads a chip it
    holds the whole model's heads: there RPA v3's mixed kernel, which unrolls every query
    compute block of every kv head, takes minutes to compile a configuration on 2 cores, and
    its widest search has 7 a step."""
    return [
        serving_step(mix, 4 * kv_heads, kv_heads, page_size)
        for kv_heads in STEP_KV_HEADS
        for mix in STEP_MIXES
        for page_size in STEP_PAGE_SIZES
    ]


STEP_WINDOWS = (4096, 1024)
"""Sliding windows of the windowed-layer steps (`window_sweep`): Mistral-7B v0.1's 4096 and
Gemma 3's local layers' 1024, the positions a token sees, its own included."""

WINDOW_STEP_HEADS = (8, 2)
"""Query and kv heads a chip of the windowed-layer steps: Mistral-7B's 32 over 8 (Llama-3-8B's
shape) over 4 chips."""


def window_sweep() -> list[Workload]:
    """The windowed-layer steps (``pallas-flash bench --windows``): the decode-only and
    prefill-heavy mixes (vLLM's pages of 16) without a window, then at each of
    `STEP_WINDOWS`: a windowed layer's cost should fall with its window, its decodes longer
    than it."""
    q_heads, kv_heads = WINDOW_STEP_HEADS
    mixes = ("decode", "vllm-2048")
    steps = [serving_step(mix, q_heads, kv_heads, VLLM_PAGE_SIZE) for mix in mixes]
    windowed = [dataclasses.replace(w, sliding_window=n) for w in steps for n in STEP_WINDOWS]
    return steps + windowed


def quick_sweep(chips: int = 1) -> list[Workload]:
    """A few points of the default sweep (about 20 minutes on a 2-core CPU): a serving batch
    of 32 ragged sequences, paged, in bfloat16 and int8; given a slice of ``chips`` > 1,
    decoding 128k tokens on one chip and on all of them. (No mixed step: RPA v3's alone
    compiles for about 7 minutes on 2 cores; `ragged_sweep` runs them.)"""
    serving = dict(batch=32, q_heads=32, kv_heads=8, lengths=SERVING_LENGTHS, cache="paged")
    quick = [
        Workload("forward", 1024),
        Workload("forward", 4096),
        Workload("forward", 4096, causal=True),
        Workload("forward_backward", 2048, causal=True),
        Workload("forward_backward", 4096, causal=True, **MLA),
        Workload("decode", 8192),
        Workload("decode", SERVING_LENGTHS[1], **serving),
        Workload("decode", SERVING_LENGTHS[1], cache_dtype="int8", **serving),
    ]
    if chips > 1:
        quick += [Workload("decode", 131072, q_heads=32, kv_heads=8, chips=n) for n in (1, chips)]
    return quick
