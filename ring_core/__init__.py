"""Framework-free core shared by both frontends.

Nothing here imports JAX or a frontend (``jax_ring`` / ``torch_bridge``): the argument checks, the
sequence layouts, the float64 reference, and (on the GPU path) the Triton + iris kernel source, the
symmetric-heap layout and the launch maths. Each frontend supplies only what differs: how arrays reach
the kernel and how ranks meet.
"""

from ring_core.layout import LAYOUTS, global_positions, layout_permutation, inverse_permutation
from ring_core.validate import AttentionSpec, check_attention_args, BACKENDS

__all__ = [
    "LAYOUTS",
    "BACKENDS",
    "AttentionSpec",
    "check_attention_args",
    "global_positions",
    "layout_permutation",
    "inverse_permutation",
]
