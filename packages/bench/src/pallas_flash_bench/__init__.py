"""Benchmark and inspect Pallas-Flash backends for TPU without a TPU.

``pallas-flash bench`` compiles every installed backend and jax's own Pallas attention kernels
for a TPU target ahead of time (libtpu's real compiler on the CPU host), and reports memory,
the copy trap, the compiler's static VLIW schedule and roofline figures; on a real TPU it also
measures wall-clock time. ``pallas-flash inspect`` prints one kernel's analysis;
``pallas-flash estimate`` estimates any JAX program with the estimator's
``pallas_flash_estimate.estimate_program``.
"""
