"""The FlashAttention-2 kernels: the forward pass (`forward`); the backward pass (`backward`:
its grid and calls, `backward_kernel`: the fused dq/dk/dv kernel, `backward_dq`: the query
gradient's own kernel); what they share (`kernel_helpers`); and forward and backward joined by
a custom VJP (`attention`)."""
