"""Attention over a mesh: context parallelism, the sequence split over chips with K/V passed round
a ring (`context_parallel`), and how a pair of chunks meets the mask (`chunk_pairs`)."""
