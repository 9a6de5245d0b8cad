"""Train a HuggingFace transformers Llama (or Mistral, with its sliding window) with every attention layer through
the ring, and check it step by step against the same model trained on one device with transformers' sdpa.

GPUs (fused kernels):   python -m jax_ring.launch --nproc-per-node 2 examples/hf_llama_train.py
CPU (gloo, torch ring): python -m torch.distributed.run --nproc-per-node 2 examples/hf_llama_train.py --cpu

The model is built from a config with random weights (nothing is downloaded). The batches are packed as
transformers' DataCollatorWithFlattening packs them (position_ids restart at each sequence, the first label of
each sequence is -100). What the user writes, besides the model and the optimiser:

    name = torch_bridge.hf.register(layout="zigzag")                # once
    model.set_attn_implementation(name)                             # or from_pretrained(..., attn_implementation=name)
    local = torch_bridge.shard_batch(batch, layout="zigzag")        # this rank's tokens, labels shifted first
    labels = local.pop("shift_labels")
    loss = torch_bridge.cross_entropy(model(**local).logits, labels)  # the one-device loss, on every rank
    loss.backward(); torch_bridge.reduce_gradients(model.parameters()); optimizer.step()

Prints the loss of every step for the ring and for one device; exits non-zero if they differ by more than
--tol (float32 throughout; TF32 off) or if the loss does not decrease.
"""

import argparse
import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_bridge

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--cpu", action="store_true", help="gloo on CPU and backend='torch'")
p.add_argument("--model", choices=("llama", "mistral"), default="llama",
               help="mistral: sliding window of --window tokens")
p.add_argument("--window", type=int, default=256)
p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
p.add_argument("--seq", type=int, default=1024, help="global sequence length (packed)")
p.add_argument("--batch", type=int, default=2)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="float64: CPU only")
p.add_argument("--tol", type=float, default=1e-3, help="largest allowed |ring loss - one-device loss|")
args = p.parse_args()

from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402

if args.cpu:
    dist.init_process_group("gloo")
    dev, backend = torch.device("cpu"), "torch"
else:
    torch_bridge.initialize()  # process group from the launcher's environment + the symmetric heap
    dev, backend = torch.device("cuda", torch.cuda.current_device()), "fused"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 matmuls as one device computes them
    torch.backends.cudnn.allow_tf32 = False
rank, world = dist.get_rank(), dist.get_world_size()

VOCAB = 256
common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=args.seq, use_cache=False,
              attention_dropout=0.0)
if args.model == "llama":
    config, cls = LlamaConfig(**common), LlamaForCausalLM
else:
    config, cls = MistralConfig(**common, sliding_window=args.window), MistralForCausalLM

name = torch_bridge.hf.register("ring_attention", layout=args.layout, backend=backend)
torch.manual_seed(0)  # the same weights and data on every rank
# One config each: set_attn_implementation writes into the model's config object.
ring = cls(copy.deepcopy(config)).to(dev, getattr(torch, args.dtype))
dense = cls(copy.deepcopy(config)).to(dev, getattr(torch, args.dtype))
dense.load_state_dict(ring.state_dict())
ring.set_attn_implementation(name)
dense.set_attn_implementation("sdpa")
opt_ring = torch.optim.AdamW(ring.parameters(), lr=3e-3)
opt_dense = torch.optim.AdamW(dense.parameters(), lr=3e-3)


def packed_batch(step):
    """Learnable packed data: each sequence follows t -> (5 t + 3) mod VOCAB from a random start; lengths random."""
    g = torch.Generator().manual_seed(step)
    ids, pos, labels = [], [], []
    for _ in range(args.batch):
        row_ids, row_pos = [], []
        while len(row_ids) < args.seq:
            n = min(int(torch.randint(args.seq // 8, args.seq // 2, (1,), generator=g)), args.seq - len(row_ids))
            t = [int(torch.randint(0, VOCAB, (1,), generator=g))]
            for _ in range(n - 1):
                t.append((5 * t[-1] + 3) % VOCAB)
            row_ids += t
            row_pos += list(range(n))
        ids.append(row_ids)
        pos.append(row_pos)
    ids, pos = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
    labels = torch.where(pos == 0, torch.full_like(ids, -100), ids)
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


losses = []
for step in range(args.steps):
    batch = packed_batch(step)
    local = torch_bridge.shard_batch(batch, layout=args.layout)
    labels = local.pop("shift_labels")
    loss = torch_bridge.cross_entropy(ring(**local).logits, labels)
    opt_ring.zero_grad()
    loss.backward()
    torch_bridge.reduce_gradients(ring.parameters())
    opt_ring.step()

    logits = dense(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
    opt_dense.zero_grad()
    ref.backward()
    opt_dense.step()
    losses.append((loss.item(), ref.item()))
    if rank == 0:
        print(f"step {step}: loss ring ({world} ranks, {args.model}, {args.layout}, backend={backend}) "
              f"{losses[-1][0]:.6f}, one device {losses[-1][1]:.6f}", flush=True)

worst = max(abs(a - b) for a, b in losses)
ok = worst <= args.tol and losses[-1][1] < losses[0][1]
if rank == 0:
    print(f"max |loss difference| over {args.steps} steps: {worst:.2e} (tolerance {args.tol:g}); "
          f"loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f}", flush=True)
if not args.cpu:
    torch_bridge.shutdown()
dist.destroy_process_group()
if not ok:
    print("FAILED: the ring's losses differ from one device's beyond the tolerance, or the loss did not decrease",
          file=sys.stderr)
    sys.exit(1)
