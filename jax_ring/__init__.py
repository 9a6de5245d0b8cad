"""Ring attention for JAX: exact softmax attention over a sequence sharded across devices.

Call ``ring_attention`` inside ``jax.shard_map`` over the mesh axis that shards the sequence, or
``ring_attention_sharded`` on global arrays; ``dot_product_attention`` is ``jax.nn.dot_product_attention`` on
global arrays under plain ``jax.jit`` (the shard_map is ours), ``flax.ring_attention_fn`` a Flax
``attention_fn``. ``to_layout`` / ``from_layout`` convert global arrays between natural token order and a
layout's order ("contiguous" or the causal-balanced "zigzag"). The twin of ``torch_bridge``.

Importing this package never imports jax_triton (it refuses to import on CPU-only JAX).
"""

from jax_ring.api import (from_layout, ring_attention, ring_attention_sharded, segment_ids_from_cu_seqlens,
                          to_layout)
from jax_ring.nn import dot_product_attention
from jax_ring import flax  # noqa: E402  (imports flax only where a model uses it)
from jax_ring.lifecycle import check_errors, initialize, is_initialized, node_size, reset, shutdown
from ring_core.sim.simulate import simulate_ring_attention, simulate_ring_attention_grad

__all__ = [
    "check_errors",
    "dot_product_attention",
    "flax",
    "from_layout",
    "initialize",
    "is_initialized",
    "node_size",
    "reset",
    "ring_attention",
    "ring_attention_sharded",
    "segment_ids_from_cu_seqlens",
    "shutdown",
    "simulate_ring_attention",
    "simulate_ring_attention_grad",
    "to_layout",
]
