"""A global batch to this rank's part of it, and back; a loss over the whole sequence from the parts.

``shard_batch`` takes the batch every rank of the group holds (``input_ids`` [batch, seq], and any of
``labels``, ``position_ids``, ``attention_mask``, as a tokenizer and transformers' data collators make them)
and returns this rank's tokens in the layout's order: ``input_ids``, ``position_ids`` (the global positions,
which RoPE needs), ``shift_labels`` (the next-token targets, taken on the whole sequence BEFORE it is split, so
that the last token of a shard keeps its true successor) and ``segment_ids`` (packed sequences from
``position_ids`` that restart, padding from ``attention_mask``; None when the batch has neither).
``cross_entropy`` gives, on every rank, the loss one device computes on the whole batch; its gradient on a rank
covers that rank's tokens, and ``reduce_gradients`` sums the parameter gradients over the group, which makes
every step the one-device step. ``gather`` puts per-rank outputs back together in natural token order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ring_core.validate import check_layout
from torch_bridge.api import from_layout, to_layout
from torch_bridge.groups import resolve_group

IGNORE_INDEX = -100  # transformers' and torch's cross-entropy default
# flash-attn varlen arguments that DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds: they describe
# the whole sequence, and the segment ids from position_ids replace them
_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _rank_world(group):
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("group was given but torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group(...) first")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _local(x, layout, rank, world, seq_axis=1):
    s = x.shape[seq_axis] // world
    return to_layout(x, layout, world, seq_axis=seq_axis).narrow(seq_axis, rank * s, s)


def segment_ids_from_batch(position_ids=None, attention_mask=None):
    """int32 [batch, seq] segment ids in natural order: a new segment wherever ``position_ids`` does not go
    up by one (transformers' packed format: positions restart at each sequence), -1 where ``attention_mask``
    is 0; None where neither gives any (one sequence per row, no padding).

    >>> import torch
    >>> segment_ids_from_batch(torch.tensor([[0, 1, 2, 0, 1, 0]])).tolist()
    [[0, 0, 0, 1, 1, 2]]
    >>> segment_ids_from_batch(attention_mask=torch.tensor([[1, 1, 0]])).tolist()
    [[0, 0, -1]]
    """
    ids = None
    if position_ids is not None:
        diff = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
        ids = (diff != 1).cumsum(-1).to(torch.int32)
        if not bool(ids.any()):
            ids = None
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        base = ids if ids is not None else torch.zeros(attention_mask.shape, dtype=torch.int32,
                                                        device=attention_mask.device)
        ids = torch.where(attention_mask.bool(), base, torch.full_like(base, -1))
    return ids


def shift_labels(labels, ignore_index: int = IGNORE_INDEX):
    """Next-token targets on the whole sequence: ``out[:, t] = labels[:, t + 1]``, the last ``ignore_index``
    (as transformers' causal-LM loss shifts them)."""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


def shard_batch(batch, *, group=None, layout="zigzag", ignore_index: int = IGNORE_INDEX):
    """This rank's part of a global batch, ready for a model whose attention runs the ring.

    ``batch``: a mapping (a dict, transformers' BatchEncoding) with ``input_ids`` (or ``inputs_embeds``)
    [batch, seq, ...] and optionally ``labels``, ``position_ids``, ``attention_mask``, the same on every rank of
    ``group`` (a ProcessGroup, a one-dimensional DeviceMesh, ``(mesh, "sp")`` or None for the default group);
    ``seq`` a multiple of the world size W (of 2W for ``layout="zigzag"``). Returns a dict with this rank's
    ``input_ids`` / ``inputs_embeds`` and ``position_ids`` (global positions, [batch, seq / W]), ``segment_ids``
    (None unless the batch packs sequences or pads), and ``shift_labels`` when ``labels`` was given (shifted on
    the whole sequence, then sharded: not to be shifted again). Other tensors whose second axis is ``seq`` are
    sharded the same way; anything else is passed on. ``attention_mask`` is consumed (into ``segment_ids``), and so
    are the flash-attn varlen keys of transformers' DataCollatorWithFlattening (``cu_seq_lens_q`` ...), which
    describe the whole sequence (the ``position_ids`` they come with give the segments).

    With the model's attention from ``torch_bridge.hf.register`` (same group and layout)::

        local = torch_bridge.shard_batch(batch, group=sp, layout="zigzag")
        labels = local.pop("shift_labels")
        logits = model(**local).logits
        loss = torch_bridge.cross_entropy(logits, labels, group=sp)   # the one-device loss, on every rank
        loss.backward()
        torch_bridge.reduce_gradients(model.parameters(), group=sp)   # then optimizer.step()
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping (dict or BatchEncoding) of tensors, got {type(batch).__name__}")
    check_layout(layout)
    group = resolve_group(group)
    rank, world = _rank_world(group)
    main = "input_ids" if batch.get("input_ids") is not None else "inputs_embeds"
    x = batch.get(main)
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError("batch needs input_ids [batch, seq] (or inputs_embeds [batch, seq, hidden]) as a tensor")
    b, s = x.shape[:2]
    unit = 2 * world if layout == "zigzag" else world
    if s % unit:
        raise ValueError(f"the sequence length {s} must be a multiple of {unit} ({'2 x ' if layout == 'zigzag' else ''}"
                         f"world size {world}) for layout={layout!r}: pad the batch (e.g. the tokenizer's "
                         f"pad_to_multiple_of={unit}, with attention_mask 0 on the padding)")
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(s, device=x.device).expand(b, s)
    elif position_ids.shape[-1] != s:
        raise ValueError(f"position_ids has {position_ids.shape[-1]} positions for {s} tokens")
    position_ids = position_ids.expand(b, s)
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None and tuple(attention_mask.shape) != (b, s):
        raise ValueError(f"attention_mask must be 2-D [batch, seq] = {(b, s)} (a padding mask), got "
                         f"{tuple(attention_mask.shape)}; the ring takes no arbitrary 4-D mask")
    segment_ids = segment_ids_from_batch(None if batch.get("position_ids") is None else position_ids, attention_mask)
    out = {}
    for key, value in batch.items():
        if key in ("position_ids", "attention_mask", "labels") or key in _VARLEN_KEYS:
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (b, s):
            out[key] = _local(value, layout, rank, world)
        else:
            out[key] = value
    out["position_ids"] = _local(position_ids, layout, rank, world)
    out["segment_ids"] = None if segment_ids is None else _local(segment_ids, layout, rank, world)
    labels = batch.get("labels")
    if labels is not None:
        if tuple(labels.shape) != (b, s):
            raise ValueError(f"labels must be [batch, seq] = {(b, s)}, got {tuple(labels.shape)}")
        out["shift_labels"] = _local(shift_labels(labels, ignore_index), layout, rank, world)
    return out


def gather(x, *, group=None, layout="zigzag", seq_axis: int = 1):
    """Every rank's part of a tensor (its tokens in layout order along ``seq_axis``) put together in natural
    token order: the inverse of the sharding in ``shard_batch``. Runs on every rank of the group (an
    all_gather); the result carries no gradient.
    """
    check_layout(layout)
    group = resolve_group(group)
    _, world = _rank_world(group)
    if world == 1:
        return from_layout(x, layout, 1, seq_axis=seq_axis)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.detach().contiguous(), group=group)
    return from_layout(torch.cat(parts, dim=seq_axis), layout, world, seq_axis=seq_axis)


def cross_entropy(logits, shift_labels, *, group=None, ignore_index: int = IGNORE_INDEX):
    """The mean next-token cross-entropy over every rank's tokens: on every rank, the loss that one device
    computes on the whole batch (transformers' causal-LM loss: mean over the targets that are not
    ``ignore_index``, in float32, float64 for float64 logits). ``logits`` [batch, seq_local, vocab] and
    ``shift_labels`` [batch, seq_local] are this rank's (``shard_batch``'s ``shift_labels``). Its gradient
    covers this rank's tokens only (divided by the global count): summing the parameter gradients over the
    group (``reduce_gradients``) gives the one-device gradient. Runs on every rank of the group (an all_reduce
    of two numbers).
    """
    group = resolve_group(group)
    _, world = _rank_world(group)
    vocab = logits.shape[-1]
    logits = logits if logits.dtype == torch.float64 else logits.float()
    local_sum = F.cross_entropy(logits.reshape(-1, vocab), shift_labels.reshape(-1).long(),
                                ignore_index=ignore_index, reduction="sum")
    count = (shift_labels != ignore_index).sum().to(local_sum.dtype)
    stats = torch.stack([local_sum.detach(), count])
    if world > 1:
        dist.all_reduce(stats, group=group)
    total = stats[1].clamp_min(1)
    return stats[0] / total + (local_sum - local_sum.detach()) / total  # the same value, bit for bit, on every rank


def reduce_gradients(parameters, *, group=None):
    """Sum the gradients of ``parameters`` over the ranks of ``group`` (in place), after ``backward`` of
    ``cross_entropy``: every rank then holds the one-device gradient. (With data parallelism on top, reduce
    over the data-parallel group as usual as well.)"""
    group = resolve_group(group)
    _, world = _rank_world(group)
    if world == 1:
        return
    for p in parameters:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
