"""A small sequence-parallel attention layer in PyTorch on top of torch_bridge.

GPUs (fused kernel):  torchrun --nproc-per-node 2 examples/torch_ring_attention.py
CPU (gloo, reference ring):  torchrun --nproc-per-node 2 examples/torch_ring_attention.py --cpu

Every rank holds its zigzag shard of the sequence; the layer's output is compared with the same layer
computed densely on the whole sequence.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import torch_bridge

p = argparse.ArgumentParser()
p.add_argument("--cpu", action="store_true", help="gloo on CPU and backend='torch'")
p.add_argument("--seq", type=int, default=4096)
args = p.parse_args()


class RingSelfAttention(nn.Module):
    def __init__(self, d_model=512, heads=8, kv_heads=2, head_dim=64, backend="auto"):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, head_dim
        self.wq = nn.Linear(d_model, heads * head_dim, bias=False)
        self.wkv = nn.Linear(d_model, 2 * kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, d_model, bias=False)
        self.attn = torch_bridge.RingAttention(is_causal=True, layout="zigzag", backend=backend)

    def forward(self, x, attn=None):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.h, self.d)
        k, v = self.wkv(x).view(b, s, 2, self.hkv, self.d).unbind(2)
        o = (attn or self.attn)(q, k.contiguous(), v.contiguous())
        return self.wo(o.reshape(b, s, self.h * self.d))


if args.cpu:
    dist.init_process_group("gloo")
    dev, dtype, backend = torch.device("cpu"), torch.float32, "torch"
else:
    torch_bridge.initialize()  # NCCL process group from torchrun's environment + the iris heap
    dev, dtype, backend = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, "fused"
rank, W = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)  # same weights and inputs on every rank
layer = RingSelfAttention(backend=backend).to(dev, dtype)
x = torch.randn(1, args.seq, 512, device=dev, dtype=dtype)
S = args.seq // W
x_local = torch_bridge.to_layout(x, "zigzag", W)[:, rank * S:(rank + 1) * S]
with torch.no_grad():
    y_local = layer(x_local)
    out = [torch.empty_like(y_local) for _ in range(W)]
    dist.all_gather(out, y_local.contiguous())
    y = torch_bridge.from_layout(torch.cat(out, dim=1), "zigzag", W)
    # The same layer on the whole sequence on this device, with dense causal attention (float32).
    def dense(q, k, v):
        g = q.shape[2] // k.shape[2]
        q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)
        return o.transpose(1, 2).to(dtype)
    y_ref = layer(x, attn=dense)
err = (y.float() - y_ref.float()).abs().max().item()
if rank == 0:
    print(f"{W} ranks, backend={backend}, seq {args.seq}: max |ring - dense| = {err:.3e} "
          f"(|y| up to {y_ref.float().abs().max().item():.2f})")
assert err < 0.05 * y_ref.float().abs().max().item()
if not args.cpu:
    torch_bridge.shutdown()
dist.destroy_process_group()
