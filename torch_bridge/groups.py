"""A process group as the custom ops (``ring_attention::fwd`` / ``::bwd`` / ``::shift``) carry it, and back.

An op's schema holds no ProcessGroup object, so the group travels as a str: "" for the default (world)
group, else its registered name (``group.group_name``), which torch.distributed resolves in the process
that runs the op. Both directions live here, once, for every op; which groups a backend accepts is the
backend's own check (``torch_bridge.fused._check_group``). ``group_to_name`` is traceable by dynamo (no
graph break, torch 2.11 and 2.13), so it runs in the Python around an op under torch.compile.
"""

from __future__ import annotations

import torch.distributed as dist


def group_to_name(group) -> str:
    return "" if group is None or group is dist.group.WORLD else group.group_name


def group_from_name(name: str):
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)
