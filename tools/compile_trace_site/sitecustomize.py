"""With this folder first on PYTHONPATH and RING_ATTENTION_COMPILE_TRACE naming a folder, every Python process
logs its Triton compiles there (tools/compile_trace.py)."""
import os

if os.environ.get("RING_ATTENTION_COMPILE_TRACE"):
    try:
        import sys

        tools = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sys.path.append(tools)
        try:
            from compile_trace import install
        finally:
            sys.path.remove(tools)
        install(os.environ["RING_ATTENTION_COMPILE_TRACE"])
    except Exception as e:  # a process without Triton, or without the repository on its path
        print(f"compile trace not installed: {type(e).__name__}: {e}")
