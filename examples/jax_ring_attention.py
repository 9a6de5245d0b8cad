"""A small sequence-parallel attention layer in JAX on top of jax_ring.

GPUs (one process per GPU, fused kernel):
    python -m jax_ring.launch --nproc-per-node 2 examples/jax_ring_attention.py
CPU (4 simulated devices, reference ring):
    python examples/jax_ring_attention.py --cpu

The layer projects x to q/k/v (GQA: fewer kv heads), runs causal ring attention over the sequence axis
"sp" with the zigzag layout (balanced causal work) and projects back. The result is compared with the
same layer computed densely on one device.
"""

import argparse
import os
import sys

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--cpu", action="store_true", help="4 simulated CPU devices and backend='xla'")
p.add_argument("--seq", type=int, default=4096, help="global sequence length")
args = p.parse_args()
if args.cpu:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax_ring  # noqa: E402
import jax_ring.reference  # noqa: E402

if not args.cpu:
    jax_ring.initialize()  # torch.distributed + jax.distributed + iris heap; before JAX touches the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

D_MODEL, HEADS, KV_HEADS, HEAD_DIM = 512, 8, 2, 64
backend = "xla" if args.cpu else "fused"
mesh = Mesh(np.array(jax.devices()), ("sp",))  # devices in process order
W = mesh.shape["sp"]


def init_params(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    s = D_MODEL ** -0.5
    return dict(wq=jax.random.normal(k1, (D_MODEL, HEADS * HEAD_DIM)) * s,
                wk=jax.random.normal(k2, (D_MODEL, KV_HEADS * HEAD_DIM)) * s,
                wv=jax.random.normal(k3, (D_MODEL, KV_HEADS * HEAD_DIM)) * s,
                wo=jax.random.normal(k4, (HEADS * HEAD_DIM, D_MODEL)) * s)


def attention_layer(params, x, attend):
    b, s, _ = x.shape
    dt = jnp.bfloat16
    q = (x @ params["wq"]).reshape(b, s, HEADS, HEAD_DIM).astype(dt)
    k = (x @ params["wk"]).reshape(b, s, KV_HEADS, HEAD_DIM).astype(dt)
    v = (x @ params["wv"]).reshape(b, s, KV_HEADS, HEAD_DIM).astype(dt)
    o = attend(q, k, v).astype(jnp.float32)
    return o.reshape(b, s, HEADS * HEAD_DIM) @ params["wo"]


def ring(q, k, v):
    return jax_ring.ring_attention(q, k, v, axis_name="sp", is_causal=True, layout="zigzag", backend=backend)


@jax.jit
def sharded_layer(params, x):
    body = lambda x: attention_layer(params, x, ring)
    return jax.shard_map(body, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))(x)


params = init_params(jax.random.key(0))
x = jax.random.normal(jax.random.key(1), (1, args.seq, D_MODEL))  # global, natural token order
xz = jax_ring.to_layout(np.asarray(x), "zigzag", W)               # zigzag order, then shard contiguously
xs = jax.make_array_from_callback(xz.shape, NamedSharding(mesh, P(None, "sp")), lambda idx: xz[idx])
y = sharded_layer(params, xs)

# Check against the same layer on one device (dense attention, float32 maths).
dense = lambda q, k, v: jax_ring.reference.dense_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                                            v.astype(jnp.float32), is_causal=True)[0]
y_ref = attention_layer(params, jnp.asarray(x), dense)
y_local = jax_ring.from_layout(np.asarray(multihost_utils.process_allgather(y, tiled=True)),
                               "zigzag", W)
err = float(np.max(np.abs(y_local - np.asarray(y_ref))))
scale = float(np.max(np.abs(np.asarray(y_ref))))
if jax.process_index() == 0:
    print(f"{W} devices, backend={backend}, seq {args.seq}: max |ring - dense| = {err:.3e} (|y| up to {scale:.2f})")
if err > 0.05 * scale:
    sys.exit("mismatch")
if not args.cpu:
    jax_ring.shutdown()
