"""The compile the estimate reads: a program compiled ahead of time for a TPU target with
libtpu on a host without a TPU (`devices`), named so another process can build it
(`program_ref`), compiled and recorded (`compiled`), in a worker process whose libtpu writes
its LLO dump (`worker`). The one stage that imports JAX."""
