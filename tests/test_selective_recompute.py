"""train.recompute = "selective" (jobs/train/parallelize.py's ``keep_products``): a recomputed GPT block's backward
redoes its elementwise ops but none of its matrix products or attention, and its gradients are the un-checkpointed
block's, bit for bit."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from jobs.models.gpt import Block
from jobs.train.parallelize import SELECTIVELY_KEPT_OPS, Stage, keep_products

PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default  # CPU float32 SDPA's kernel


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] += 1
        return func(*args, **(kwargs or {}))


def _backward(policy: str = "") -> tuple[collections.Counter, list[torch.Tensor]]:
    """The ops one backward of a GPT block dispatches, and its gradients (input's, then parameters'): the block
    a pipeline stage's, recomputed by ``policy`` (empty: not recomputed)."""
    torch.manual_seed(0)
    block = Block(32, 4, 0.0)
    stage = Stage([block], False, [block], recompute=bool(policy), policy=policy or "full")
    x = torch.randn(2, 16, 32, requires_grad=True)
    loss = stage(x).square().sum()
    with OpCounter() as counter:
        loss.backward()
    return counter.calls, [x.grad, *(param.grad for param in block.parameters())]


def _products(calls: collections.Counter) -> int:
    return sum(calls[op] for op in PRODUCTS)


def test_selective_recomputes_no_product_and_trains_exactly() -> None:
    kept_calls, kept_grads = _backward()
    full_calls, full_grads = _backward("full")
    calls, grads = _backward("selective")
    assert ATTENTION in SELECTIVELY_KEPT_OPS
    # full: the forward's products (QKV, attention's projection, the MLP's first layer; early stop spares the last)
    # and attention again, on top of the gradient products
    assert _products(full_calls) >= _products(kept_calls) + 3
    assert full_calls[ATTENTION] == 1
    # selective: the gradient products only, attention kept; the norms and GeLU redone
    assert _products(calls) == _products(kept_calls)
    assert calls[ATTENTION] == 0
    assert calls[torch.ops.aten.native_layer_norm.default] == 2
    assert calls[torch.ops.aten.gelu.default] == 1
    for reference, grad in zip(kept_grads, grads, strict=True):  # the same ops on the same CPU: bit for bit
        torch.testing.assert_close(grad, reference, rtol=0, atol=0)
    for reference, grad in zip(kept_grads, full_grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=0, atol=0)


@pytest.mark.parametrize("op", [torch.ops.aten.gelu.default, torch.ops.aten.native_layer_norm.default,
                                torch.ops.aten.add.Tensor, torch.ops._c10d_functional.all_reduce.default,
                                torch.ops._c10d_functional.wait_tensor.default])
def test_selective_recomputes_elementwise_ops_and_collectives(op) -> None:
    """Collectives are redone as full checkpointing redoes them: every TP rank at the same point of backward."""
    assert keep_products(None, op) is CheckpointPolicy.PREFER_RECOMPUTE



def test_compiled_selective_recomputes_no_product() -> None:
    """Under train.compile the checkpoint is compiled with the block inside: the backward graph (AOTAutograd's
    min-cut partitioner, inductor's, without inductor's kernels) redoes the norms and GeLU, and of the products
    only the gradients' (two per weight: QKV, attention's projection, the MLP's two)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    backward_graphs = []

    def forward_graph(graph, inputs):
        return make_boxed_func(graph.forward)

    def backward_graph(graph, inputs):
        backward_graphs.append(graph)
        return make_boxed_func(graph.forward)

    torch._dynamo.reset()
    block = Block(32, 4, 0.0)
    stage = Stage([block], False, [block], recompute=True, policy="selective")
    stage.calls[0].compile(backend=aot_autograd(fw_compiler=forward_graph, bw_compiler=backward_graph,
                                                partition_fn=min_cut_rematerialization_partition))
    stage(torch.randn(2, 16, 32, requires_grad=True)).square().sum().backward()
    (graph,) = backward_graphs
    calls = collections.Counter(node.target for node in graph.graph.nodes if node.op == "call_function")
    assert _products(calls) == 8
    assert calls[ATTENTION] == 0
    assert calls[torch.ops.aten.native_layer_norm.default] == 2
    assert calls[torch.ops.aten.gelu.default] == 1


@pytest.mark.cuda
def test_on_the_gpu_selective_keeps_less_than_none_more_than_full_and_redoes_no_product() -> None:
    """bf16 autocast on the GPU (cuBLAS, CUDA's SDPA kernel): what forward leaves for backward shrinks from none to
    selective to full, as the planner models it (parallel/plan.py: Korthikanti's count, product_bytes, the layer
    input); selective's backward redoes no product and no attention; its gradients are none's. Prints the
    measured kept bytes and step times."""
    from parallel.plan import Transformer

    device, batch, seq, width, heads, depth = torch.device("cuda"), 8, 1024, 1024, 16, 4
    torch.manual_seed(0)
    blocks = [Block(width, heads, 0.0).to(device) for _ in range(depth)]
    x = torch.randn(batch, seq, width, device=device, requires_grad=True)
    kept, calls, grads, times = {}, {}, {}, {}
    for policy in ("", "selective", "full"):
        stage = Stage(blocks, True, blocks, recompute=bool(policy), policy=policy or "full")
        for _ in range(3):  # warm-up, then the kept bytes and the ops of one step
            x.grad = None
            for param in stage.parameters():
                param.grad = None
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            y = stage(x)
            kept[policy] = (torch.cuda.memory_allocated() - before - y.numel() * y.element_size()) / depth
            with OpCounter() as counter:
                y.float().square().mean().backward()
        calls[policy], grads[policy] = counter.calls, [x.grad, *(param.grad for param in stage.parameters())]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            stage(x).float().square().mean().backward()
        end.record()
        torch.cuda.synchronize()
        times[policy] = start.elapsed_time(end) / 10
    attention = [op for op in SELECTIVELY_KEPT_OPS if "attention" in str(op)]
    model = Transformer(depth, width, heads, seq, 256)
    tokens = batch * seq
    planned = {"": model.activation_bytes(tokens, 1, 2, scores=False),
               "selective": model.product_bytes(tokens, 1, 2), "full": tokens * width * 2}
    for policy in kept:
        print(f"recompute={policy or 'none'}: kept {kept[policy] / 2**20:.1f} MiB per block (planned "
              f"{planned[policy] / 2**20:.1f}), step {times[policy]:.2f} ms")
    assert kept[""] > kept["selective"] > kept["full"]
    assert _products(calls["selective"]) == _products(calls[""]) < _products(calls["full"])
    assert sum(calls["selective"][op] for op in attention) == 0 < sum(calls["full"][op] for op in attention)
    for reference, grad in zip(grads[""], grads["selective"], strict=True):  # bf16 kernels, atomics in some
        assert (grad - reference).norm() <= 1e-2 * reference.norm()  # attention backward: close, maybe not bitwise
