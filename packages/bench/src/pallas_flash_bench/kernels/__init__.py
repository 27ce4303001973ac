"""The kernel rows: a call's workload (`workloads`), the subjects compiled for it (our backends:
`subjects`; jax's and others' kernels: `references` and the `*_reference` adapters) and the
figures a row derives (`row_figures`)."""
