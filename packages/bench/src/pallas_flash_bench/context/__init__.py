"""The context-parallel rows: a ring attention step's workload (`context_workloads`), its programs
compiled (`context_steps`) and their figures (`context_figures`)."""
