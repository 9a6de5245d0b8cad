"""torch_bridge.hf and the ring-flash-attn signatures on backend="fused": the real forward and backward kernels
in the Triton interpreter on one rank whose heap is a CPU buffer (the fixtures of test_fused_wiring.py), a
transformers Llama's logits and weight gradients against the float64 model within the tolerance table."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed: pip install -e '.[test]'")

import torch_bridge  # noqa: E402
from ring_core import testing  # noqa: E402
from test_fused_wiring import _check_now, cpu_heap  # noqa: E402,F401  (fixtures)


@pytest.fixture
def fused_cpu(cpu_heap, monkeypatch):  # noqa: F811  (the imported fixture)
    """backend='fused' through the interpreter for CPU tensors."""
    monkeypatch.setattr(torch_bridge.lifecycle, "track", _check_now)
    monkeypatch.setattr(torch_bridge.api, "_on_gpu", lambda x: True)
    return cpu_heap


def _llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=53, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype)


def _run(model, batch):
    model.zero_grad()
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 53).double(),
                                            batch["input_ids"][:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.detach().double().numpy() for n, p in model.named_parameters() if "self_attn" in n}
    return logits.detach().double().numpy(), grads


def test_llama_fused_interpreter(fused_cpu):
    """Packed rows (position_ids restart) through the fused kernels: logits and the attention weights' gradients
    within twice the float32 sdpa model's error against the float64 model, plus the table's float32 slack."""
    ids = torch.randint(0, 53, (1, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])}
    ref64 = _llama(torch.float64)
    ref64.set_attn_implementation("sdpa")
    low = _llama(torch.float32)
    low.set_attn_implementation("sdpa")
    ring = _llama(torch.float32)
    ring.set_attn_implementation(torch_bridge.hf.register("ring_attention_fused", layout="contiguous",
                                                          backend="fused"))
    (l64, g64), (ll, gl), (lr, gr) = _run(ref64, batch), _run(low, batch), _run(ring, batch)
    kinds = [kind for kind, _ in fused_cpu.plans]  # the fused kernels ran: a forward and a backward per layer
    assert kinds.count("fwd") == 2 and kinds.count("bwd") >= 2, kinds
    assert all(spec.segmented for _, spec in fused_cpu.plans)
    testing.check("logits", lr, l64, ll, "float32", "out")
    for name in g64:
        testing.check(name, gr[name], g64[name], gl[name], "float32", "grad")


def test_zigzag_ring_flash_attn_fused_interpreter(fused_cpu):
    q, k, v = (torch.from_numpy(x).float() for x in testing.random_inputs(2, 1, 10, 4, 2, 16, "float32"))
    out, lse, _ = torch_bridge.zigzag_ring_flash_attn_func(q, k, v, 0.0, None, True, return_attn_probs=True,
                                                           backend="fused")
    assert fused_cpu.plans and fused_cpu.plans[0][0] == "fwd"
    testing.check_attention("zigzag_ring_flash_attn_func", out.numpy(), lse.numpy(), q.double().numpy(),
                            k.double().numpy(), v.double().numpy(), "float32", is_causal=True)
