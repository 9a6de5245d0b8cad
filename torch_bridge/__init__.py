"""Ring attention for PyTorch: exact softmax attention over a sequence sharded across the ranks of a process group.

One process per rank under torch.distributed; call ``ring_attention`` (or the module ``RingAttention``) on every
rank with its shard. ``to_layout`` / ``from_layout`` convert global tensors between natural token order and a
layout's order ("contiguous" or the causal-balanced "zigzag"). The twin of ``jax_ring``; never imports JAX.
``torch_bridge.procs.LocalGroup`` starts local gloo workers for tests and CPU demos.
Drop-in entry points: ``torch_bridge.hf.register`` (HuggingFace transformers), ring-flash-attn's signatures
(``zigzag_ring_flash_attn_func`` and the others), ``shard_batch`` / ``gather`` / ``cross_entropy`` /
``reduce_gradients`` for a batch split over the ranks.
"""

from ring_core.sim.simulate import simulate_ring_attention, simulate_ring_attention_grad
from torch_bridge.api import (BACKENDS, RingAttention, from_layout, ring_attention, segment_ids_from_cu_seqlens,
                              to_layout)
from torch_bridge.batch import cross_entropy, gather, reduce_gradients, shard_batch
from torch_bridge.flash_attn import (ring_flash_attn_func, ring_flash_attn_kvpacked_func,
                                     ring_flash_attn_qkvpacked_func, ring_flash_attn_varlen_func,
                                     ring_flash_attn_varlen_kvpacked_func, ring_flash_attn_varlen_qkvpacked_func,
                                     zigzag_ring_flash_attn_func, zigzag_ring_flash_attn_kvpacked_func,
                                     zigzag_ring_flash_attn_qkvpacked_func, zigzag_ring_flash_attn_varlen_func,
                                     zigzag_ring_flash_attn_varlen_kvpacked_func,
                                     zigzag_ring_flash_attn_varlen_qkvpacked_func)
from torch_bridge.lifecycle import check_errors, initialize, is_initialized, node_size, reset, shutdown
from torch_bridge import hf  # noqa: E402  (imports transformers only inside hf.register)

__all__ = [
    "BACKENDS",
    "RingAttention",
    "check_errors",
    "cross_entropy",
    "from_layout",
    "gather",
    "hf",
    "initialize",
    "is_initialized",
    "node_size",
    "reduce_gradients",
    "reset",
    "ring_attention",
    "ring_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func",
    "ring_flash_attn_varlen_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func",
    "segment_ids_from_cu_seqlens",
    "shard_batch",
    "shutdown",
    "simulate_ring_attention",
    "simulate_ring_attention_grad",
    "to_layout",
    "zigzag_ring_flash_attn_func",
    "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func",
    "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
]
