"""The FlashAttention-2 kernels: the forward pass (`forward`), the backward pass (`backward`, with
its query-gradient kernel `backward_dq`), what they share (`kernel_helpers`), and the three
joined by a custom VJP (`attention`)."""
