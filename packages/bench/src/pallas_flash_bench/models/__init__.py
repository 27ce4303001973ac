"""The model rows: a LLaMa step's workload (`model_workloads`), its flops (`model_flops`), its
programs compiled (`model_steps`) and their figures (`model_figures`), against MaxText's own
train step (`maxtext_steps`) and serving program (`maxtext_serving`)."""
