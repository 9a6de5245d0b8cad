"""HuggingFace transformers: every attention layer of a model through the ring.

    import torch_bridge
    name = torch_bridge.hf.register(group=sp_group, layout="zigzag")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)  # or set_attn_implementation(name)
    local = torch_bridge.shard_batch(batch, group=sp_group, layout="zigzag")
    labels = local.pop("shift_labels")
    loss = torch_bridge.cross_entropy(model(**local).logits, labels, group=sp_group)

The registered function takes transformers' attention-interface call (q/k/v ``[batch, heads, seq_local,
head_dim]``, K/V with the model's key-value heads: GQA without repeating them) and runs ``ring_attention`` on
this rank's tokens in the layout's order: causal from the module (``is_causal``), ``scaling`` as the scale,
``sliding_window`` (Mistral, Qwen2, Gemma style) as the window ``(sliding_window - 1, 0)`` in global token
order, packed batches from ``segment_ids`` (``shard_batch`` makes them) or else from ``position_ids`` that
restart. A mask function is registered under the same name: a padding ``attention_mask`` with zeros raises
(``shard_batch`` turns it into segment ids), and so does an arbitrary 4-D mask, attention dropout, a logit
soft-cap or attention sinks, naming what to change. Tested with transformers 5.25.0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ring_core.layout import global_positions
from ring_core.validate import check_layout
from torch_bridge.api import BACKENDS, ring_attention
from torch_bridge.groups import resolve_group

_UNSUPPORTED = {
    "softcap": "a logit soft-cap (Gemma 2's attn_logit_softcapping): set it to None in the config",
    "s_aux": "attention sinks (gpt-oss)",
    "sinks": "attention sinks (gpt-oss)",
    "cu_seq_lens_q": "flash-attn varlen arguments (cu_seq_lens_q): give the collator's position_ids to "
                     "torch_bridge.shard_batch instead, which turns them into segment ids",
    "cu_seq_lens_k": "flash-attn varlen arguments (cu_seq_lens_k): give the collator's position_ids to "
                     "torch_bridge.shard_batch instead, which turns them into segment ids",
}


def _rank_world(group):
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _segments_from_positions(position_ids, batch, seq_local, group, layout):
    """Segment ids of this rank's tokens from their within-sequence positions: a token at global index g with
    position p belongs to the sequence that starts at g - p, the same number for all of that sequence's tokens
    on every rank (no communication)."""
    rank, world = _rank_world(group)
    g = global_positions(torch, rank, world, seq_local, layout).to(position_ids.device)
    starts = (g - position_ids).expand(batch, seq_local)
    if bool((starts < 0).any()):
        raise ValueError("position_ids are larger than the tokens' global indices: give the model the position_ids "
                         "of torch_bridge.shard_batch (global positions in the layout's order), with the same "
                         "group and layout as torch_bridge.hf.register")
    return starts.to(torch.int32)


def make_attention_function(*, group=None, layout="zigzag", backend="auto", deterministic=False):
    """The function that ``register`` registers: transformers' attention-interface signature
    ``(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs)`` ->
    ``(out [batch, seq_local, heads, head_dim], None)``."""
    check_layout(layout)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def ring_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               is_causal=None, sliding_window=None, **kwargs):
        if attention_mask is not None:
            raise ValueError(
                f"ring attention takes no attention_mask tensor (got one of shape {tuple(attention_mask.shape)}): an "
                "arbitrary 4-D mask cannot be split over the ring. Causal masking comes from the model, sliding "
                "windows from its config, packing and padding from segment_ids: pass the batch through "
                "torch_bridge.shard_batch and call the model with its outputs (no attention_mask)")
        if dropout:
            raise ValueError(f"attention dropout {dropout} is not supported by ring attention: set "
                             "config.attention_dropout = 0.0 (or call model.eval())")
        for name, what in _UNSUPPORTED.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"ring attention does not support {what}")
        if kwargs.get("output_attentions"):
            raise ValueError("ring attention computes no attention weights: pass output_attentions=False")
        b, _, s, _ = query.shape
        if key.shape[2] != s:
            raise ValueError(
                f"ring attention needs as many keys as queries on each rank, got {s} queries and {key.shape[2]} "
                "keys (a KV cache of earlier tokens): train or prefill with use_cache=False; generate with "
                "another attention implementation")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        window = None
        if sliding_window is not None:
            w = int(sliding_window)
            window = (w - 1, -1 if causal else w - 1)
        g = resolve_group(group)
        if "segment_ids" in kwargs:
            segment_ids = kwargs["segment_ids"]
        elif kwargs.get("position_ids") is not None:
            segment_ids = _segments_from_positions(kwargs["position_ids"], b, s, g, layout)
        else:
            segment_ids = None
        if segment_ids is not None:
            segment_ids = segment_ids.to(device=query.device, dtype=torch.int32).expand(b, s)
        out = ring_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), group=g,
                             is_causal=bool(causal), scale=scaling, layout=layout, backend=backend,
                             segment_ids=segment_ids, window_size=window, deterministic=deterministic)
        return out, None

    return ring_attention_forward


def _no_mask(*args, attention_mask=None, **kwargs):
    """The mask function registered with the attention: the ring builds its masks itself; a padding mask with
    zeros raises (turn it into segment ids with torch_bridge.shard_batch)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("ring attention takes padding as segment ids, not as an attention_mask: pass the batch "
                         "(with its attention_mask) through torch_bridge.shard_batch and call the model with its "
                         "outputs, which hold segment_ids and no attention_mask")
    return None


def register(name="ring_attention", *, group=None, layout="zigzag", backend="auto", deterministic=False):
    """Register the ring with transformers' ``AttentionInterface`` (and a mask function with its
    ``AttentionMaskInterface``) under ``name``; return ``name``, for
    ``AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)``.

    ``group``: the ranks that share each sequence (a ProcessGroup, a one-dimensional DeviceMesh,
    ``(mesh, "sp")``, or None for the default group); ``layout``: which tokens each rank holds, the same as
    given to ``shard_batch``; ``backend`` and ``deterministic`` as in ``ring_attention``.

    >>> import torch_bridge
    >>> torch_bridge.hf.register("ring_attention_doc", layout="contiguous")   # doctest: +SKIP
    'ring_attention_doc'
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError("torch_bridge.hf needs transformers: pip install 'ring-attention-iris[hf]' "
                          "(or pip install transformers)") from e
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    AttentionInterface.register(name, make_attention_function(group=group, layout=layout, backend=backend,
                                                              deterministic=deterministic))
    AttentionMaskInterface.register(name, _no_mask)
    return name
