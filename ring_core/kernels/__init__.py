"""The fused kernels: tl (``tl_fwd``, ``tl_bwd``) and Gluon Hopper (``gluon_fwd``, ``gluon_bwd``) forward and
backward, and what they share."""
