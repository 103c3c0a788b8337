"""``train.fused_head_loss``: the LM head and its cross-entropy a chunk of tokens at a time
(``parallel.tensor_parallel.LinearCrossEntropy``) must give the unfused head's loss and gradients, whole and
split over the vocabulary by TP, without ever making a tensor of the logits' size; the trainer's runs with it
are in tests/test_3d.py."""

from __future__ import annotations

import numpy as np
import pytest

from hpc.runtime.mesh import MeshShape, build_mesh
from tests.ranks import run_ranks
from tests.test_tensor_parallel import _logit_sized

TOKENS, HIDDEN, VOCAB = (3, 20), 16, 96
IGNORED = [0, 7]  # positions of every row whose target is -100


def _case(dtype_name: str = "float32"):
    import torch

    torch.manual_seed(0)
    hidden = torch.randn(*TOKENS, HIDDEN, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.5)
    targets = torch.randint(0, VOCAB, TOKENS).index_fill_(1, torch.tensor(IGNORED), -100)
    upstream = torch.tensor(0.7)  # the loss's gradient from above (a loss scale, a microbatch's share)
    return hidden, weight, targets, upstream


def _unfused(hidden, weight, targets, upstream):
    import torch
    import torch.nn.functional as F

    loss = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), targets.flatten())  # the mean, -100 left out
    return loss, torch.autograd.grad(loss * upstream, (hidden, weight))


def _fused(hidden, weight, targets, upstream, chunk_elements, dtype=None, group=None):
    import torch

    from parallel.tensor_parallel import LinearCrossEntropy

    head = LinearCrossEntropy(weight, group, dtype or torch.float32, chunk_elements)
    assert head(hidden) is hidden  # the model's own head call passes the hidden state on
    loss = head(hidden, targets)
    return loss, torch.autograd.grad(loss * upstream, (hidden, weight))


@pytest.mark.parametrize("chunk_rows", [1, 7, 60])
def test_the_fused_head_loss_is_the_linear_then_torch_s_cross_entropy(chunk_rows: int) -> None:
    """float32: chunks of 1, 7 (a ragged last one) and all 60 rows give torch's mean loss and both gradients
    (made in the forward pass, scaled by the loss's gradient in backward), the ignored targets no gradient."""
    import torch

    hidden, weight, targets, upstream = _case()
    expected, (grad_h, grad_w) = _unfused(hidden, weight, targets, upstream)
    losses, (fused_h, fused_w) = _fused(hidden, weight, targets, upstream, chunk_rows * VOCAB)
    # float32 sums of 16 products and of 96 exponentials in another order: a few ulps of the largest term
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_h, grad_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_w, grad_w, rtol=1e-5, atol=1e-5)
    assert losses.dim() == 0 and not fused_h[:, IGNORED].any()


def test_the_weight_gradient_is_one_product_per_group_of_chunks_not_one_per_chunk() -> None:
    """60 chunks of one row: their gradients of the logits are kept until a group holds min(hidden, rows / 4) = 15
    rows, so the weight's gradient is summed in 4 products, not 60 (each adds into the whole float32 sum)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default:
                self.shapes.append(tuple(out.shape))
            return out

    hidden, weight, targets, upstream = _case()
    with Products() as products:
        _fused(hidden, weight, targets, upstream, VOCAB)
    assert products.shapes.count((VOCAB, HIDDEN)) == 4


def test_in_bf16_it_is_the_autocast_head_within_bf16_rounding() -> None:
    """dtype bf16: the product rounds as the head's own under autocast (its inputs to bf16); the loss within a
    bf16 ulp of the logits, relative to the unfused loss on bf16-rounded inputs."""
    import torch

    hidden, weight, targets, upstream = _case()
    low = (hidden.detach().bfloat16().float().requires_grad_(), weight.detach().bfloat16().float())
    expected, _ = _unfused(low[0], torch.nn.Parameter(low[1]), targets, upstream)
    losses, (grad_h, grad_w) = _fused(hidden, weight, targets, upstream, 7 * VOCAB, torch.bfloat16)
    # the only rounding left is the bf16 product's: each logit within 2^-8 of its own size
    logit_scale = (low[0] @ low[1].t()).abs().max().item()
    torch.testing.assert_close(losses, expected, rtol=0, atol=2 * logit_scale * 2**-8)
    assert grad_h.dtype == hidden.dtype and grad_w.dtype == weight.dtype


def test_no_tensor_of_the_logits_size_is_made_forward_or_backward() -> None:
    """Chunks of 8 rows: forward and backward make no logit-sized tensor; the unfused head makes the logits, and
    torch's loss its copies, in both directions."""
    import torch

    hidden, weight, targets, upstream = _case()
    logits = TOKENS[0] * TOKENS[1] * VOCAB
    results = {}

    def forward_fused() -> None:
        from parallel.tensor_parallel import LinearCrossEntropy

        results["fused"] = LinearCrossEntropy(weight, None, torch.float32, 8 * VOCAB)(hidden, targets)

    def backward_fused() -> None:
        torch.autograd.grad((results["fused"] * upstream).sum(), (hidden, weight))

    assert (_logit_sized(forward_fused, logits), _logit_sized(backward_fused, logits)) == (0, 0)
    assert _logit_sized(lambda: _unfused(hidden, weight, targets, upstream), logits) >= 3


def _products(fn) -> int:
    """The matrix products ``fn`` makes (aten.mm and addmm calls)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.calls


def test_whole_the_gradients_are_made_in_the_forward_pass_and_nothing_twice() -> None:
    """Whole (no TP group): forward makes each chunk's logits and its two gradient products, 3 per chunk, as the
    unfused head and its backward do; backward only scales them (no product)."""
    import torch

    from parallel.tensor_parallel import LinearCrossEntropy

    hidden, weight, targets, upstream = _case()
    chunks = -(-TOKENS[0] * TOKENS[1] // 8)
    loss = {}
    made = _products(lambda: loss.update(value=LinearCrossEntropy(weight, None, torch.float32, 8 * VOCAB)(hidden,
                                                                                                        targets)))
    assert made == 3 * chunks
    assert _products(lambda: torch.autograd.grad(loss["value"] * upstream, (hidden, weight))) == 0


def _split_over_tp(world):
    """Each rank's vocabulary slice of the head, the hidden state through ``copy_to_tp``: losses and the hidden
    state's gradient whole, the weight's gradient this rank's slice."""
    import torch
    import torch.distributed as dist

    group = build_mesh(MeshShape(dp=1, tp=world.size, pp=1), world.rank).group("tp")
    hidden, weight, targets, upstream = _case()
    expected, (grad_h, grad_w) = _unfused(hidden, weight, targets, upstream)
    rank_weight = torch.nn.Parameter(weight.detach().chunk(world.size)[dist.get_rank(group)].clone())
    losses, (fused_h, fused_w) = _fused(hidden, rank_weight, targets, upstream, 7 * VOCAB, group=group)
    own = grad_w.chunk(world.size)[dist.get_rank(group)]
    return [(a.detach().numpy(), e.detach().numpy()) for a, e in ((losses, expected), (fused_h, grad_h),
                                                                  (fused_w, own))]


@pytest.mark.parametrize("tp", [2, 4])
def test_split_over_the_vocabulary_it_is_the_whole_head_s_loss(tp: int) -> None:
    for rank, pairs in enumerate(run_ranks(tp, _split_over_tp)):
        for name, (actual, expected) in zip(("loss", "hidden grad", "weight grad"), pairs, strict=True):
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5, err_msg=f"rank {rank}: {name}")


def test_the_planner_counts_one_chunk_of_logits_and_a_group_s_kept_gradients_with_the_fused_loss() -> None:
    """``hpc plan`` (torch-free) keeps its own copies of the chunk's size and of the share of the rows whose
    gradients are kept: the same as the loss's; a spec with the fused loss is predicted lighter at Llama 3's
    vocabulary by the fp32 logits less a chunk of them and the bf16 gradients of a group's logits (the hidden
    size's rows or a quarter of the tokens, 2048 here)."""
    from pathlib import Path

    from hpc.config import load_spec
    from jobs.models.shape import spec_model
    from parallel.cluster import load_cluster
    from parallel.plan import FUSED_LOSS_CHUNK_BYTES, FUSED_LOSS_KEPT_SHARE, Layout, memory_bytes, spec_training
    from parallel.tensor_parallel import KEPT_ROWS_SHARE, LOSS_CHUNK_ELEMENTS

    assert FUSED_LOSS_CHUNK_BYTES == 4 * LOSS_CHUNK_ELEMENTS and FUSED_LOSS_KEPT_SHARE == KEPT_ROWS_SHARE
    path = Path(__file__).resolve().parents[1] / "jobs" / "bench" / "llama3b_bench.toml"
    spec, fused = load_spec(path, []), load_spec(path, ["train.fused_head_loss=true"])
    model, cluster, layout = spec_model(spec), load_cluster("h100-dgx"), Layout(1, 1, 1, 1)
    saved = (memory_bytes(model, spec_training(spec, model.hidden), cluster, layout)
             - memory_bytes(model, spec_training(fused, model.hidden), cluster, layout))
    assert saved == 4 * 8 * 1024 * 128256 - FUSED_LOSS_CHUNK_BYTES - 2 * 2048 * 128256


def _train_on_gpu(world, run_dir: str, name: str, fused: bool) -> list[float]:
    import json

    from hpc.config import spec_from_dict
    from jobs.train.loop import train

    spec = spec_from_dict({
        "job": {"run_dir": run_dir, "name": name, "seed": 5},
        "model": {"kind": "gpt", "n_layers": 2, "n_heads": 2, "d_model": 64, "seq_len": 32},
        "data": {"name": "licenses", "batch_size": 16},
        "train": {"steps": 10, "lr": 3e-3, "optimizer": "adamw", "log_every": 100, "bf16_autocast": True,
                  "fused_head_loss": fused},
        "parallel": {"dp": 1, "tp": world.size, "pp": 1},
    })
    train(spec, world, build_mesh(MeshShape(1, world.size, 1), world.rank, world.device))
    return [json.loads(line)["loss"] for line in (spec.run_path / "metrics.jsonl").open()] if world.rank == 0 else []


@pytest.mark.cuda
@pytest.mark.parametrize("tp", [1, 2])
def test_on_the_gpu_in_bf16_the_fused_head_loss_trains_as_the_unfused_one(tmp_path, tp: int) -> None:
    """bf16 autocast on the GPU, whole and split over TP (ranks sharing the GPU over Gloo): the fused head's bf16
    products round as the unfused head's, so the losses stay within bf16's rounding of each other."""
    unfused = run_ranks(tp, _train_on_gpu, str(tmp_path), "unfused", False, timeout=300, device="cuda")[0]
    fused = run_ranks(tp, _train_on_gpu, str(tmp_path), "fused", True, timeout=300, device="cuda")[0]
    assert len(fused) == 10 and fused == pytest.approx(unfused, rel=2e-2)
