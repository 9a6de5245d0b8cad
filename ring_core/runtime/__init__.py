"""What running the kernels on GPUs needs: the symmetric heap, GPU assignment, process spawning, compiles."""
