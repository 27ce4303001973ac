"""The kernel rows: a call's workload (`workloads`), the subjects compiled for it (our backends:
`subjects`; jax's and others' kernels: `references` and the `*_reference` adapters), the
figures a row derives (`row_figures`), and what a run's rows are held against: jax's kernels
(`against_references`), one chip (`chip_scaling`), and the same sweep on another stack
(`stack_comparison`)."""
