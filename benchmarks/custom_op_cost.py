"""Host time of one call through a ``torch.library`` custom op against a ``torch.autograd.Function`` doing the
same (issue 20's host path: why eager fused calls go through ``torch_bridge.api._EagerFused``).

No kernel: both wrap a body that only allocates the two outputs, with the fused forward op's argument list
(three tensors, optional segment ids, scale, flags, layout, window, group name, timeout, backward check) and an
autograd registration; ``direct`` is the body alone. CPU, eager, grad enabled on q (as in training)::

    python -m benchmarks.custom_op_cost --calls 2000 --csv benchmarks/results/custom_op_cost_cpu_2026-12-02.csv
"""

from __future__ import annotations

import argparse
import time
from typing import Optional

import torch

from benchmarks.harness import write_rows


@torch.library.custom_op("ring_attention_bench::fwd", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Optional[torch.Tensor], scale: float, causal: bool,
        layout: str, window: list[int], group: str, timeout: Optional[float],
        check_backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), q.new_empty((1,))


@_op.register_fake
def _(q, k, v, s, scale, causal, layout, window, group, timeout, check_backward):
    return q.new_empty(q.shape), q.new_empty((1,))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3])


def _backward(ctx, dout, dlse):
    return (None,) * 11


_op.register_autograd(_backward, setup_context=_setup)


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q.new_empty(q.shape), q.new_empty((1,))

    @staticmethod
    def backward(ctx, dout, dlse):
        return None, None, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--csv", default=None)
    a = ap.parse_args(argv)
    q = torch.randn(1, 16, 4, 8, requires_grad=True)
    k = v = torch.randn(1, 16, 4, 8)
    routes = {"custom_op": lambda: _op(q, k, v, None, 0.1, True, "zigzag", [-1, -1], "g", None, True),
              "autograd.Function": lambda: _Function.apply(q, k, v),
              "direct": lambda: (q.new_empty(q.shape), q.new_empty((1,)))}
    rows = []
    for name, fn in routes.items():
        for _ in range(200):
            fn()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fn()
        us = (time.perf_counter() - t0) / a.calls * 1e6
        rows.append(dict(route=name, calls=a.calls, us_per_call=round(us, 1), torch=torch.__version__))
        print(rows[-1], flush=True)
    if a.csv:
        write_rows(a.csv, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
