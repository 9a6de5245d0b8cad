"""Ring attention for PyTorch: exact softmax attention over a sequence sharded across the ranks of a process group.

One process per rank under torch.distributed; call ``ring_attention`` (or the module ``RingAttention``) on every
rank with its shard. ``to_layout`` / ``from_layout`` convert global tensors between natural token order and a
layout's order ("contiguous" or the causal-balanced "zigzag"). The twin of ``jax_ring``; never imports JAX.
``torch_bridge.procs.LocalGroup`` starts local gloo workers for tests and CPU demos.
"""

from ring_core.sim.simulate import simulate_ring_attention, simulate_ring_attention_grad
from torch_bridge.api import (BACKENDS, RingAttention, from_layout, ring_attention, segment_ids_from_cu_seqlens,
                              to_layout)
from torch_bridge.lifecycle import check_errors, initialize, is_initialized, reset, shutdown

__all__ = [
    "BACKENDS",
    "RingAttention",
    "check_errors",
    "from_layout",
    "initialize",
    "is_initialized",
    "reset",
    "ring_attention",
    "segment_ids_from_cu_seqlens",
    "shutdown",
    "simulate_ring_attention",
    "simulate_ring_attention_grad",
    "to_layout",
]
