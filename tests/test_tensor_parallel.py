"""Tensor parallelism must compute what the single-device layers and model compute.

Each rank builds the full layer from a seed, runs it locally as the reference, then
runs its TP shard of the same layer on the same input; outputs and the gradients of
inputs and weights are compared slice by slice.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpc.config import spec_from_dict
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.numerics import LOSS_RTOL, assert_trained_close
from tests.ranks import run_ranks

TINY_GPT = {"kind": "gpt", "n_layers": 2, "n_heads": 4, "d_model": 32, "seq_len": 16}
BATCH = 8
STEPS = 10
LR = {"adam": 3e-3, "sgd": 0.3}
# Trained parameters: tests/numerics.py (Adam's bound, SGD's relative to each tensor's movement).


def _tp_group(world, tp: int):
    return build_mesh(MeshShape(dp=world.size // tp, tp=tp, pp=1), world.rank).group("tp")


def _own_slice(tensor, dim: int, group):
    import torch.distributed as dist

    return tensor.detach().chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]


def _pairs(**named):
    """(actual, expected) tensors as numpy, for assertions in the test process."""
    return {name: (a.detach().numpy().copy(), e.detach().numpy().copy()) for name, (a, e) in named.items()}


def _assert_pairs(per_rank: list[dict]) -> None:
    for rank, pairs in enumerate(per_rank):
        for name, (actual, expected) in pairs.items():
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}: {name}")


def _linear_reference():
    """A seeded Linear(12, 8), its input and upstream gradient, after the single-device backward."""
    import torch

    torch.manual_seed(0)
    full = torch.nn.Linear(12, 8)
    x = torch.randn(3, 5, 12, requires_grad=True)
    upstream = torch.randn(3, 5, 8)
    reference = full(x)
    (reference * upstream).sum().backward()
    return full, x, upstream, reference


def _column_linear(world, tp):

    from parallel.tensor_parallel import ColumnParallelLinear

    group = _tp_group(world, tp)
    full, x, upstream, reference = _linear_reference()

    layer = ColumnParallelLinear.from_full(full, group)
    x_tp = x.detach().clone().requires_grad_()
    y = layer(x_tp)
    (y * _own_slice(upstream, -1, group)).sum().backward()
    return _pairs(
        output=(y, _own_slice(reference, -1, group)),
        input_grad=(x_tp.grad, x.grad),
        weight_grad=(layer.weight.grad, _own_slice(full.weight.grad, 0, group)),
        bias_grad=(layer.bias.grad, _own_slice(full.bias.grad, 0, group)),
    )


def _row_linear(world, tp):

    from parallel.tensor_parallel import RowParallelLinear

    group = _tp_group(world, tp)
    full, x, upstream, reference = _linear_reference()

    layer = RowParallelLinear.from_full(full, group)
    x_tp = _own_slice(x, -1, group).clone().requires_grad_()
    y = layer(x_tp)
    (y * upstream).sum().backward()
    return _pairs(
        output=(y, reference),
        input_grad=(x_tp.grad, _own_slice(x.grad, -1, group)),
        weight_grad=(layer.weight.grad, _own_slice(full.weight.grad, 1, group)),
        bias_grad=(layer.bias.grad, full.bias.grad),
    )


def _vocab_embedding(world, tp):
    import torch

    from parallel.tensor_parallel import VocabParallelEmbedding

    group = _tp_group(world, tp)
    torch.manual_seed(0)
    full = torch.nn.Embedding(16, 6)
    ids = torch.cat([torch.randperm(16), torch.randint(0, 16, (19,))]).view(5, 7)  # every id, some twice
    upstream = torch.randn(5, 7, 6)
    reference = full(ids)
    (reference * upstream).sum().backward()

    layer = VocabParallelEmbedding.from_full(full, group)
    y = layer(ids)
    (y * upstream).sum().backward()
    return _pairs(output=(y, reference), weight_grad=(layer.weight.grad, _own_slice(full.weight.grad, 0, group)))


def _vocab_cross_entropy(world, tp):
    import torch
    import torch.nn.functional as F

    from parallel.tensor_parallel import cross_entropy

    group = _tp_group(world, tp)
    torch.manual_seed(0)
    # Logits in the hundreds: exp() overflows float32 unless the row max is taken out first.
    logits = (torch.randn(6, 5, 16) * 50).requires_grad_()
    targets = torch.randint(0, 16, (6, 5))
    weights = torch.rand(6, 5)
    reference = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(6, 5)
    (reference * weights).sum().backward()

    shard = _own_slice(logits, -1, group).clone().requires_grad_()
    loss = cross_entropy(shard, targets, group, chunk_elements=16)  # 2 rows a chunk: 15 chunks
    (loss * weights).sum().backward()
    return _pairs(loss=(loss, reference), logits_grad=(shard.grad, _own_slice(logits.grad, -1, group)))


@pytest.mark.parametrize("layer", [_column_linear, _row_linear, _vocab_embedding, _vocab_cross_entropy])
def test_layer_matches_the_single_device_layer(layer) -> None:
    """tp=2 here; the tp=4 GPT run below covers every layer at tp=4."""
    _assert_pairs(run_ranks(2, layer, 2))


def _gathers(world):
    """The functional all-gather and the sum-gather (Gloo's way for ranks sharing a GPU) of the same parts."""
    import torch

    from parallel.tensor_parallel import _all_gather, _all_gather_by_sum

    group = _tp_group(world, 2)
    torch.manual_seed(world.rank)
    parts = [torch.randn(3, 5) * 1e30, torch.tensor([[-0.0, float("inf"), -1e-40]]), torch.randn(2, 4).bfloat16()]
    return [(_all_gather(part, group), _all_gather_by_sum(part, group)) for part in parts]


def test_the_gather_by_a_sum_is_the_all_gather_bit_for_bit() -> None:
    """What ranks sharing a GPU over Gloo gather with, since Gloo's gather into one tensor crashes on CUDA
    tensors (pytorch#152645): here on the CPU, against the functional all-gather, huge, tiny and infinite
    values and bf16 alike (a zero's sign aside: -0 + 0 is +0)."""
    import torch

    for rank_pairs in run_ranks(2, _gathers):
        for gathered, summed in rank_pairs:
            assert gathered.dtype == summed.dtype and gathered.shape == summed.shape
            assert torch.equal(gathered, summed)


def _logit_sized(fn, numel: int) -> int:
    """How many tensors of at least ``numel`` elements ``fn()`` creates."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Created(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ not in ("view", "_unsafe_view", "reshape", "detach", "alias"):
                self.count += sum(isinstance(t, torch.Tensor) and t.numel() >= numel for t in tree_flatten(out)[0])
            return out

    created = Created()
    with created:
        fn()
    return created.count


def test_the_loss_makes_no_copy_of_the_logits_and_is_torch_s_cross_entropy() -> None:
    """bf16 logits read 8 rows at a time: the forward creates no tensor of their size and the backward one, the
    gradient; torch's loss on their float32 copy (what transformers and a plain loop do) makes two in forward (the
    copy, log_softmax's output) and three in backward. The values are torch's, targets of -100 left out."""
    import torch
    import torch.nn.functional as F

    from parallel.tensor_parallel import cross_entropy

    torch.manual_seed(0)
    logits = (torch.randn(4, 16, 1024) * 4).bfloat16().requires_grad_()
    targets = torch.randint(0, 1024, (4, 16)).index_fill_(1, torch.tensor([0, 5]), -100)
    weights = torch.rand(4, 16)
    results = {}

    def ours() -> None:
        results["ours"] = cross_entropy(logits, targets, chunk_elements=8 * 1024)

    def torch_s() -> None:
        results["torch"] = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")

    assert (_logit_sized(ours, logits.numel()), _logit_sized(torch_s, logits.numel())) == (0, 2)
    torch.testing.assert_close(results["ours"].flatten(), results["torch"], rtol=1e-6, atol=1e-6)
    assert results["ours"].dtype == torch.float32 and not results["ours"][:, [0, 5]].any()
    grads = {}
    for name in ("ours", "torch"):
        def backward(name=name) -> None:
            grads[name] = torch.autograd.grad((results[name].flatten() * weights.flatten()).sum(), logits)[0]

        assert _logit_sized(backward, logits.numel()) == (1 if name == "ours" else 3), name
    # each a float32 gradient rounded to bf16: a value on a rounding boundary may land one bf16 ulp apart
    torch.testing.assert_close(grads["ours"], grads["torch"], rtol=2**-7, atol=1e-6)


def _train_gpt(world, dp, tp, model_overrides, optimizer, seed=5):
    """STEPS training steps of the tiny GPT on the licenses text; the losses and the full parameters."""
    import torch
    import torch.distributed as dist

    from jobs.data.datasets import byte_windows, dp_shard, load_licenses, window_starts
    from jobs.models.gpt import build_gpt, lm_loss
    from jobs.train.parallelize import parallelize_tp
    from parallel.tensor_parallel import full_state_dict

    cfg = spec_from_dict({"model": {**TINY_GPT, **model_overrides}}).model
    mesh = build_mesh(MeshShape(dp=dp, tp=tp, pp=1), world.rank)
    tp_group = mesh.group("tp") if tp > 1 else None
    torch.manual_seed(seed)  # dropout masks
    model = build_gpt(cfg, seed)
    initial = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    if tp_group is not None:
        parallelize_tp(model, model.tp_plan, tp_group)
    opt = (
        torch.optim.Adam(model.parameters(), lr=LR["adam"])
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=LR["sgd"], momentum=0.9)
    )
    corpus = load_licenses()
    losses = []
    for step in range(STEPS):
        starts = window_starts(len(corpus.train), BATCH, cfg.seq_len, seed, step)
        inputs, targets = byte_windows(corpus.train, dp_shard(starts, mesh.index("dp"), dp), cfg.seq_len)
        loss = lm_loss(model(inputs), targets, tp_group)
        opt.zero_grad()
        loss.backward()
        mean_loss = loss.detach().clone()
        if dp > 1:  # plain DP averaging; the compressed ring is wired in by the training loop
            for param in model.parameters():
                dist.all_reduce(param.grad, group=mesh.group("dp"))
                param.grad /= dp
            dist.all_reduce(mean_loss, group=mesh.group("dp"))
        opt.step()
        losses.append(mean_loss.item() / dp)
    state = full_state_dict(model, tp_group) if tp_group is not None else model.state_dict()
    return losses, {k: v.numpy().copy() for k, v in state.items()}, initial


@pytest.mark.parametrize(
    ("dp", "tp", "model_overrides", "optimizer"),
    [
        (1, 2, {}, "adam"),
        (2, 2, {}, "adam"),
        (1, 4, {}, "sgd"),
        (1, 2, {"dropout": 0.1}, "sgd"),
    ],
    ids=["dp1-tp2-adam", "dp2-tp2-adam", "dp1-tp4-sgd", "dp1-tp2-dropout-sgd"],
)
def test_gpt_trains_exactly_like_the_single_device_gpt(dp, tp, model_overrides, optimizer) -> None:
    ((ref_losses, ref_state, initial),) = run_ranks(1, _train_gpt, 1, 1, model_overrides, optimizer)
    assert ref_losses[-1] < ref_losses[0]  # it does learn
    per_rank = run_ranks(dp * tp, _train_gpt, dp, tp, model_overrides, optimizer)
    for rank, (losses, state, rank_initial) in enumerate(per_rank):
        assert losses == pytest.approx(ref_losses, rel=LOSS_RTOL), f"rank {rank}"
        assert_trained_close(state, ref_state, optimizer=optimizer, lr=LR[optimizer], steps=STEPS, initial=initial,
                             name=f"rank {rank}")
        for name, value in ref_state.items():
            np.testing.assert_array_equal(rank_initial[name], initial[name])
            assert not np.array_equal(value, initial[name]), f"{name} did not train"


def _layout_errors(world):
    import torch

    from hpc.errors import LayoutError
    from parallel.tensor_parallel import ColumnParallelLinear

    group = _tp_group(world, 2)
    messages = []
    for build in (
        lambda: ColumnParallelLinear.from_full(torch.nn.Linear(4, 5), group),
    ):
        try:
            build()
        except LayoutError as err:
            messages.append(str(err))
    return messages


def test_a_model_tp_does_not_divide_is_a_layout_error() -> None:
    for messages in run_ranks(2, _layout_errors):
        assert messages == ["Linear(4, 5) output features: 5 is not divisible by parallel.tp=2"]
