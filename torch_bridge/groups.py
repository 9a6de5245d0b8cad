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


def resolve_group(group):
    """What ``group=`` takes everywhere, as a ProcessGroup (or None: the default group).

    A ProcessGroup or None as it is; a one-dimensional ``DeviceMesh``
    (``init_device_mesh(..., mesh_dim_names=("sp",))``, or ``mesh["sp"]`` of a larger one) as its group;
    ``(mesh, "sp")``, a mesh and the name (or index) of the dimension that shards the sequence, as that
    dimension's group. Anything else is returned as it is.
    """
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group is a DeviceMesh of {group.ndim} dimensions {group.mesh_dim_names}; pass the dimension that "
                "shards the sequence: group=(mesh, 'sp') or group=mesh['sp']")
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, dim = group
        names = mesh.mesh_dim_names or ()
        if isinstance(dim, str) and dim not in names:
            raise ValueError(f"{dim!r} is not a dimension of the DeviceMesh (dimensions {names}); "
                             "pass the name of the dimension that shards the sequence")
        return mesh.get_group(dim)
    return group  # anything else as it is: torch.distributed's own checks name it (e.g. a non-member's group)
