"""The block policy: which block sizes a call gets within the chip's VMEM (`block_sizes`) and which
blocks each kernel visits under its mask (`schedule`)."""
