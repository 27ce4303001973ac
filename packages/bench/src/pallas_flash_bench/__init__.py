"""Benchmark and inspect Pallas-Flash backends for TPU without a TPU.

``pallas-flash bench`` compiles every installed backend and jax's own Pallas attention kernels
for a TPU target ahead of time (libtpu's real compiler on the CPU host), and reports memory,
the copy trap, the compiler's static VLIW schedule and roofline figures; on a real TPU it also
measures wall-clock time. ``pallas-flash inspect`` prints one kernel's analysis.

``estimate_program(fn, *abstract_args, target=...)`` estimates any JAX program the same way,
calibrated against published v5e measurements (``pallas-flash estimate`` from the shell).
"""

__all__ = ["ProgramEstimate", "estimate_program"]


def __getattr__(name: str) -> object:
    # `estimate_program` imports jax and the estimator: only when asked for
    if name in __all__:
        from pallas_flash_bench import any_program

        return getattr(any_program, name)
    raise AttributeError(f"module 'pallas_flash_bench' has no attribute {name!r}")
