"""Ring attention for JAX: exact softmax attention over a sequence sharded across devices.

Call ``ring_attention`` inside ``jax.shard_map`` over the mesh axis that shards the sequence, or
``ring_attention_sharded`` on global arrays. ``to_layout`` / ``from_layout`` convert global arrays between
natural token order and a layout's order ("contiguous" or the causal-balanced "zigzag").

Importing this package never imports jax_triton (it refuses to import on CPU-only JAX).
"""

from jax_ring.api import from_layout, ring_attention, ring_attention_sharded, to_layout
from jax_ring.distributed import check_errors, initialize, is_initialized, reset, shutdown
from jax_ring.simulate import simulate_ring_attention, simulate_ring_attention_grad

__all__ = [
    "check_errors",
    "initialize",
    "is_initialized",
    "reset",
    "shutdown",
    "simulate_ring_attention",
    "simulate_ring_attention_grad",
    "ring_attention",
    "ring_attention_sharded",
    "to_layout",
    "from_layout",
]
