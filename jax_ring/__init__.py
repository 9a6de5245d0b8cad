"""Ring attention for JAX: exact softmax attention over a sequence sharded across devices.

Call ``ring_attention`` inside ``jax.shard_map`` over the mesh axis that shards the sequence, or
``ring_attention_sharded`` on global arrays. ``to_layout`` / ``from_layout`` convert global arrays between
natural token order and a layout's order ("contiguous" or the causal-balanced "zigzag"). The twin of
``torch_bridge``.

Importing this package never imports jax_triton (it refuses to import on CPU-only JAX).
"""

from jax_ring.api import (from_layout, ring_attention, ring_attention_sharded, segment_ids_from_cu_seqlens,
                          to_layout)
from jax_ring.lifecycle import check_errors, initialize, is_initialized, reset, shutdown
from ring_core.sim.simulate import simulate_ring_attention, simulate_ring_attention_grad

__all__ = [
    "check_errors",
    "from_layout",
    "initialize",
    "is_initialized",
    "reset",
    "ring_attention",
    "ring_attention_sharded",
    "segment_ids_from_cu_seqlens",
    "shutdown",
    "simulate_ring_attention",
    "simulate_ring_attention_grad",
    "to_layout",
]
