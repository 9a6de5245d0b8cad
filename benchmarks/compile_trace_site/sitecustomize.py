"""With this folder first on PYTHONPATH and RING_ATTENTION_COMPILE_TRACE naming a folder, every Python process
logs its Triton compiles there (benchmarks/compile_trace.py)."""
import os

if os.environ.get("RING_ATTENTION_COMPILE_TRACE"):
    try:
        from benchmarks.compile_trace import install

        install(os.environ["RING_ATTENTION_COMPILE_TRACE"])
    except Exception as e:  # a process without Triton, or without the repository on its path
        print(f"compile trace not installed: {type(e).__name__}: {e}")
