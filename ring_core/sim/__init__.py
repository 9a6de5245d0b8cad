"""The CPU simulator: the real kernels in the Triton interpreter, one thread per rank."""
