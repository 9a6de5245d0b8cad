"""Train a small causal language model with sequence-parallel ring attention, and check it against the same
model trained on one device.

GPUs (fused forward and backward kernels):  torchrun --nproc-per-node 2 examples/torch_train.py
CPU (gloo, reference ring):                  torchrun --nproc-per-node 2 examples/torch_train.py --cpu
Data parallel x sequence parallel (2 x 2):   torchrun --nproc-per-node 4 examples/torch_train.py --dp 2
``--compile`` trains the ring model under torch.compile(fullgraph=True): the fused kernels (GPUs) and the
reference ring's exchanges (CPU) are custom ops in the graph.

The ranks form a ("dp", "sp") DeviceMesh: every rank holds the same weights; each "dp" group takes its slice
of the batch, and the ring attention runs over the "sp" group, each rank holding its zigzag shard of every
sequence (balanced causal work). The loss is the mean next-token cross-entropy over the whole batch: each rank
sums its own tokens', the sum is all-reduced, and so are the weight gradients, which makes every step equal to
a step on the whole batch. The same model, with dense causal attention on the full sequences, is trained on
this device from the same initial weights and data; the two loss curves must agree (float32 throughout).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torch_bridge
from torch.distributed.device_mesh import init_device_mesh

p = argparse.ArgumentParser()
p.add_argument("--cpu", action="store_true", help="gloo on CPU and backend='torch'")
p.add_argument("--seq", type=int, default=1024, help="global sequence length")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--batch", type=int, default=2)
p.add_argument("--dp", type=int, default=1, help="data-parallel groups (the ranks are dp x sp)")
p.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the ring model")
args = p.parse_args()

VOCAB, D_MODEL, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 128, 4, 2, 32, 2


def ring_attention(q, k, v):
    return torch_bridge.ring_attention(q, k, v, group=SP_GROUP, is_causal=True, layout="zigzag", backend=BACKEND)


def dense_attention(q, k, v):
    g = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)
    return o.transpose(1, 2)


class Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attention = attention
        self.norm1, self.norm2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.wq = nn.Linear(D_MODEL, HEADS * HEAD_DIM, bias=False)
        self.wkv = nn.Linear(D_MODEL, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, D_MODEL, bias=False)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(b, s, HEADS, HEAD_DIM)
        k, v = self.wkv(h).view(b, s, 2, KV_HEADS, HEAD_DIM).unbind(2)
        x = x + self.wo(self.attention(q, k, v).reshape(b, s, HEADS * HEAD_DIM))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """No positional embedding: the causal mask alone orders the tokens (enough for this check)."""

    def __init__(self, attention):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(Block(attention) for _ in range(LAYERS))
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


if args.cpu:
    dist.init_process_group("gloo")
    dev, BACKEND = torch.device("cpu"), "torch"
else:
    torch_bridge.initialize()  # process group from torchrun's environment (NCCL, or gloo on a shared GPU) + heap
    dev, BACKEND = torch.device("cuda", torch.cuda.current_device()), "fused"
rank = dist.get_rank()
mesh = init_device_mesh(dev.type, (args.dp, dist.get_world_size() // args.dp), mesh_dim_names=("dp", "sp"))
SP_GROUP = mesh.get_group("sp")
W, sp_rank, dp_rank = mesh.size(1), mesh.get_local_rank("sp"), mesh.get_local_rank("dp")
S, B = args.seq // W, args.batch // args.dp

torch.manual_seed(0)  # same weights and data on every rank
ring_model = TinyLM(ring_attention).to(dev)
dense_model = TinyLM(dense_attention).to(dev)
dense_model.load_state_dict(ring_model.state_dict())
opt_ring = torch.optim.AdamW(ring_model.parameters(), lr=3e-3)
if args.compile:
    ring_model = torch.compile(ring_model, fullgraph=True)
opt_dense = torch.optim.AdamW(dense_model.parameters(), lr=3e-3)
# Learnable data: each sequence follows t -> (5 t + 3) mod VOCAB from a random start.
start = torch.randint(0, VOCAB, (args.steps, args.batch, 1), device=dev)
data = start.clone()
for _ in range(args.seq):
    data = torch.cat([data, (5 * data[..., -1:] + 3) % VOCAB], dim=-1)
n_tokens = args.batch * args.seq

losses = []
for step in range(args.steps):
    inputs, targets = data[step, :, :-1], data[step, :, 1:]
    # This dp group's batch slice; sequence parallel: this rank's zigzag shard of it and of its targets.
    rows = slice(dp_rank * B, (dp_rank + 1) * B)
    local_in = torch_bridge.to_layout(inputs[rows], "zigzag", W, seq_axis=1)[:, sp_rank * S:(sp_rank + 1) * S]
    local_tg = torch_bridge.to_layout(targets[rows], "zigzag", W, seq_axis=1)[:, sp_rank * S:(sp_rank + 1) * S]
    logits = ring_model(local_in)
    loss_sum = F.cross_entropy(logits.reshape(-1, VOCAB), local_tg.reshape(-1), reduction="sum")
    opt_ring.zero_grad()
    (loss_sum / n_tokens).backward()
    for prm in ring_model.parameters():  # every rank's tokens contribute to every weight (all dp x sp ranks)
        dist.all_reduce(prm.grad)
    opt_ring.step()
    total = loss_sum.detach().clone()
    dist.all_reduce(total)
    ring_loss = total.item() / n_tokens

    dense_loss = F.cross_entropy(dense_model(inputs).reshape(-1, VOCAB), targets.reshape(-1))
    opt_dense.zero_grad()
    dense_loss.backward()
    opt_dense.step()
    losses.append((ring_loss, dense_loss.item()))
    if rank == 0:
        print(f"step {step}: loss ring ({args.dp} x {W} ranks, backend={BACKEND}) {ring_loss:.6f}, "
              f"one device {dense_loss.item():.6f}", flush=True)

worst = max(abs(a - b) for a, b in losses)
if rank == 0:
    print(f"max |loss difference| over {args.steps} steps: {worst:.2e}; loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f}")
assert worst < 1e-3, f"ring and single-device training diverged ({worst})"
assert losses[-1][1] < losses[0][1], "the loss did not decrease"
if not args.cpu:
    torch_bridge.shutdown()
dist.destroy_process_group()
