"""Reading the compiler's output: optimized HLO text and libtpu's LLO dump files."""
