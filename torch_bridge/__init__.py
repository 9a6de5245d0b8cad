"""PyTorch frontend: ring attention with one process per rank under torch.distributed.

Never imports JAX. ``torch_bridge.procs.LocalGroup`` starts local gloo workers for tests and CPU demos.
"""

from torch_bridge.api import BACKENDS, RingAttention, from_layout, ring_attention, to_layout
from torch_bridge.fused import check_errors, initialize, reset, shutdown

__all__ = ["BACKENDS", "RingAttention", "check_errors", "from_layout", "initialize", "reset", "ring_attention", "shutdown",
           "to_layout"]
