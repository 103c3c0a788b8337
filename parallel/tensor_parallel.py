"""Tensor parallelism: layers whose weights are split across the ranks of a TP group.

Follows Megatron-Core's ``tensor_parallel``: a column-parallel linear splits its
outputs, a row-parallel linear splits its inputs and sums the partial products, so
column then row costs one all-reduce forward and one backward. The collectives are
tiny autograd Functions rather than ``torch.distributed.nn.functional``: those have
no "identity forward, all-reduce backward" pair, and each Function here states in
its docstring what it does each way. Inside, the collectives are torch's functional ones
(``_functional_collectives``: a new tensor out, nothing in place), which torch.compile traces
into a block's graph as they are; torch 2.11's Dynamo rewrote an in-place ``all_reduce`` in a
traced backward into zeros, and TP under ``train.compile`` then trained only its last layers. Gloo's
gather into one tensor (what the functional all-gather runs) crashes on CUDA tensors (pytorch#152645), so
ranks sharing a GPU over Gloo gather by a sum (``_all_gather``).
The TP process group is always an argument. Each collective is counted by the run's stall inspector on
the group's channel (``tp group [0, 1]``: ``hpc.observe.probe.group_collective``, which the training loop
registers the group with), so a rank that never enters one is named; inside a compiled block it is not
(Dynamo traces the collectives into the graph, and counting there would break it).

Every layer is built from the full single-device module (``from_full``) by taking
this rank's slice, so the same seed gives the same weights under every layout.
Vocabulary-split logits never get gathered: ``cross_entropy`` reduces only the row max, the sum of
exponentials and the target logit; whole or split, it makes no copy of the logits (it reads them a chunk
of rows at a time in float32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from hpc.errors import LayoutError
from hpc.observe.probe import group_collective
from hpc.runtime.placement import carries_cuda

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

IGNORE_INDEX = -100  # a target the loss leaves out (prompt tokens): torch's and Hugging Face's ignore_index


class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce (sum) of the gradient over the TP group.

    Marks where a replicated activation enters a split computation: each rank's
    gradient covers only its shard, the input's gradient is their sum.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group, "backward all-reduce"), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce (sum) over the TP group; backward: identity.

    Joins partial results (row-parallel products, embedding lookups) into the
    replicated activation; every rank then holds the same gradient for it.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group, "forward all-reduce")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """forward: all-gather along the last dimension over the TP group; backward: this rank's slice.

    Turns a column-parallel layer's split output into the whole one (transformers'
    ``colwise_gather_output``); the gradient of the whole output is replicated, so
    each rank keeps the columns its shard produced.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return torch.cat(_all_gather(x, group).chunk(dist.get_world_size(group)), dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


def _all_reduce(x: torch.Tensor, group: ProcessGroup, name: str = "all-reduce") -> torch.Tensor:
    """The sum over ``group``, a new tensor (autograd may share ``x`` with other nodes)."""
    with group_collective(group, name):
        return _sum(x, group)


def _sum(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


def _all_gather(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The ranks' ``x`` stacked along dimension 0, a new tensor."""
    with group_collective(group, "all-gather"):
        if x.is_cuda and not carries_cuda(group):
            return _all_gather_by_sum(x, group)
        return funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), 0, group))


def _all_gather_by_sum(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The all-gather as a sum over ``group`` of each rank's ``x`` in its slot of zeros: exact (one term of each
    sum is not zero), for Gloo on CUDA tensors, whose gather into one tensor copies device memory as host
    memory and crashes the rank (pytorch#152645)."""
    slots = x.new_zeros((dist.get_world_size(group), *x.shape))
    slots[dist.get_rank(group)] = x
    return _sum(slots, group).flatten(0, 1)


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """forward: identity; backward: all-reduce over ``group``."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """forward: all-reduce over ``group``; backward: identity."""
    return _ReduceFromTP.apply(x, group)


def _shard(full: torch.Tensor, dim: int, group: ProcessGroup, what: str) -> nn.Parameter:
    """This rank's contiguous slice of ``full`` along ``dim``, as a fresh parameter."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if full.shape[dim] % size:
        raise LayoutError(f"{what}: {full.shape[dim]} is not divisible by parallel.tp={size}")
    chunk = full.shape[dim] // size
    return nn.Parameter(full.detach().narrow(dim, rank * chunk, chunk).clone())


class _ShardedLinear(nn.Module):
    """A Linear layer's shard: this rank's weight (and bias, split or whole) and the TP group it is split over.
    ``product`` computes the shard's ``F.linear`` (``jobs.train.float8`` makes it a Float8 matmul)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: ProcessGroup) -> None:
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group
        self.product = F.linear


class ColumnParallelLinear(_ShardedLinear):
    """``y = x W^T + b`` with the output features split across ranks; the output stays split,
    or is gathered whole with ``gather_output`` (Megatron's flag)."""

    partition_dims: ClassVar[dict[str, int]] = {"weight": 0, "bias": 0}

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group: ProcessGroup,
                 gather_output: bool = False) -> None:
        super().__init__(weight, bias, group)
        self.gather_output = gather_output

    @classmethod
    def from_full(cls, linear: nn.Linear, group: ProcessGroup, gather_output: bool = False) -> ColumnParallelLinear:
        what = f"Linear({linear.in_features}, {linear.out_features}) output features"
        bias = None if linear.bias is None else _shard(linear.bias, 0, group, what)
        return cls(_shard(linear.weight, 0, group, what), bias, group, gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(copy_to_tp(x, self.group), self.weight, self.bias)
        return _GatherFromTP.apply(y, self.group) if self.gather_output else y


class RowParallelLinear(_ShardedLinear):
    """``y = x W^T + b`` with the input features split across ranks; the output is replicated.

    Takes the split input a column-parallel layer produces; the bias is added once,
    after the sum, so it stays whole on every rank.
    """

    partition_dims: ClassVar[dict[str, int]] = {"weight": 1}

    @classmethod
    def from_full(cls, linear: nn.Linear, group: ProcessGroup) -> RowParallelLinear:
        what = f"Linear({linear.in_features}, {linear.out_features}) input features"
        bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        return cls(_shard(linear.weight, 1, group, what), bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(self.product(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split; ids outside this rank's range look up zeros."""

    partition_dims: ClassVar[dict[str, int]] = {"weight": 0}

    def __init__(self, weight: nn.Parameter, group: ProcessGroup) -> None:
        super().__init__()
        self.weight, self.group = weight, group
        self.vocab_start = dist.get_rank(group) * weight.shape[0]

    @classmethod
    def from_full(cls, embedding: nn.Embedding, group: ProcessGroup) -> VocabParallelEmbedding:
        what = f"Embedding({embedding.num_embeddings}, {embedding.embedding_dim}) vocabulary"
        return cls(_shard(embedding.weight, 0, group, what), group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_tp(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


# Logits taken to float32 at a time by the loss, fused with the head or not: 256 MiB of temporaries at most, and
# at most an eighth of the logits. Fewer, larger chunks than the 16 MiB it took before: at Llama 3's vocabulary
# of 128k and 16k tokens, 16 MiB was 32 rows, 512 chunks and some 9,000 kernel launches a step, which the GPU
# waited on (make bench-gpu's 128k row took 0.36 s where hpc plan predicts 0.25).
LOSS_CHUNK_ELEMENTS = 1 << 26
MIN_LOSS_CHUNKS = 8
KEPT_ROWS_SHARE = 4  # the fused loss's kept gradients of the logits (_WeightGradient): at most a quarter of the rows


def _slice_targets(targets: torch.Tensor, local_vocab: int, group: ProcessGroup | None, chunk_rows: int,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[slice]]:
    """The targets as this rank's vocabulary slice (``group``'s rank-th, or the whole) indexes them: (the flat
    targets, their ids in the slice, 0 where outside, the outside mask) and the rows' chunks."""
    flat_targets = targets.reshape(-1)
    vocab_start = dist.get_rank(group) * local_vocab if group is not None else 0
    local_targets = flat_targets - vocab_start
    outside = (local_targets < 0) | (local_targets >= local_vocab)
    chunks = [slice(start, start + chunk_rows) for start in range(0, len(flat_targets), chunk_rows)]
    return flat_targets, local_targets.masked_fill(outside, 0), outside, chunks


def _join_slices(sums: torch.Tensor, outside: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Per token, (the sum of exponentials, the target logit) over the whole vocabulary from each slice's (all
    below the same row max): the target logit counted by the slice holding it."""
    sums[1].masked_fill_(outside, 0.0)
    if group is not None:
        with group_collective(group, "loss sums all-reduce"):
            dist.all_reduce(sums, group=group)
    return sums


def _softmax_gradient(exponentials: torch.Tensor, rows: slice, local_targets: torch.Tensor, hit: torch.Tensor,
                      sum_exp: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(softmax - one_hot(target)) * scale`` of one chunk from its float32 ``exp(logit - row max)``, in place;
    ``hit``: a float32 column, 1 where the row's target is in this slice of the vocabulary."""
    softmax = exponentials.div_(sum_exp[rows].unsqueeze(-1))
    softmax.scatter_add_(-1, local_targets[rows].unsqueeze(-1), -hit[rows])
    return softmax.mul_(scale[rows])


class _CrossEntropy(torch.autograd.Function):
    """forward: per-token cross-entropy, the logits read ``chunk_rows`` rows at a time in float32, so no copy of
    the whole logits is made (at a vocabulary of 128k and 16k tokens a float32 copy is 8 GiB). With a group the
    logits are its ranks' vocabulary slices, and two all-reduces of per-token numbers (the row max; the sum of
    exponentials with the target logit) make the whole vocabulary's. backward: ``softmax - one_hot(target)``,
    recomputed chunk by chunk from the saved logits straight into the gradient, the one tensor of their size it
    makes; no communication. A target equal to ``ignore_index`` has loss 0 and no gradient."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group: ProcessGroup | None, ignore_index: int,
                chunk_rows: int) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        flat_targets, local_targets, outside, chunks = _slice_targets(targets, flat.shape[1], group, chunk_rows)
        row_max = torch.empty(len(flat), dtype=torch.float32, device=flat.device)
        for rows in chunks:
            row_max[rows] = flat[rows].amax(dim=-1)  # exact in float32 whatever the logits' dtype
        if group is not None:
            with group_collective(group, "loss max all-reduce"):
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        sums = torch.empty(2, len(flat), dtype=torch.float32, device=flat.device)  # exponentials, target logit
        for rows in chunks:
            shifted = flat[rows].float() - row_max[rows].unsqueeze(-1)
            sums[1, rows] = shifted.gather(-1, local_targets[rows].unsqueeze(-1)).squeeze(-1)
            sums[0, rows] = shifted.exp_().sum(dim=-1)
        sum_exp, target_logit = _join_slices(sums, outside, group)
        ignored = flat_targets == ignore_index
        ctx.save_for_backward(logits, local_targets, outside, ignored, row_max, sum_exp)
        ctx.chunks = chunks
        return (sum_exp.log() - target_logit).masked_fill_(ignored, 0.0).view(targets.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        logits, local_targets, outside, ignored, row_max, sum_exp = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        grad = torch.empty_like(flat)
        hit = (~outside).to(torch.float32).unsqueeze(-1)
        scale = grad_loss.reshape(-1).masked_fill(ignored, 0.0).unsqueeze(-1)
        for rows in ctx.chunks:
            exponentials = (flat[rows].float() - row_max[rows].unsqueeze(-1)).exp_()
            grad[rows] = _softmax_gradient(exponentials, rows, local_targets, hit, sum_exp, scale)
        return grad.view_as(logits), None, None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: ProcessGroup | None = None,
                  ignore_index: int = IGNORE_INDEX, chunk_elements: int = LOSS_CHUNK_ELEMENTS) -> torch.Tensor:
    """Per-token cross-entropy (``reduction="none"``, float32) of logits of any float dtype, holding no copy of
    them (``_CrossEntropy``). With ``group`` the logits are split over it by vocabulary: ``logits[..., v]`` is
    token ``rank * V_local + v``'s, as a ``ColumnParallelLinear`` head makes them. ``targets`` holds
    full-vocabulary ids, or ``ignore_index`` where a token is not counted (loss 0 and no gradient there, as
    ``F.cross_entropy(reduction="none")``); other ids outside the vocabulary are not checked (a check would read
    the device from the host)."""
    chunk_rows = max(1, min(chunk_elements, logits.numel() // MIN_LOSS_CHUNKS) // logits.shape[-1])
    return _CrossEntropy.apply(logits, targets, group, ignore_index, chunk_rows)


class _WeightGradient:
    """The fused head's weight gradient summed over the chunks, a group of chunks per product: each chunk's
    gradient of the logits is kept in ``dtype`` until the group holds as many rows as the hidden size (its bytes
    then no more than the weight's in ``dtype``; at most a quarter of the rows), then one product adds the group
    into the sum. Added per chunk, the sum's read and write (8 bytes per weight element in float32: 1 GiB at
    128k x 2048) cost more than the chunk's own product: on an H200 at 128k, 32 chunks made the fused loss 8%
    slower than the unfused one."""

    def __init__(self, weight: torch.Tensor, inputs: torch.Tensor, chunk_rows: int) -> None:
        """``inputs``: the flat hidden state in ``dtype``, as the chunks' products take it."""
        rows = min(inputs.shape[1], len(inputs) // KEPT_ROWS_SHARE)
        self.group_rows = chunk_rows * max(1, rows // chunk_rows)
        self.inputs, self.start, self.kept = inputs, 0, 0
        self.total = torch.zeros_like(weight)
        self.stash = inputs.new_empty(min(self.group_rows, len(inputs)), weight.shape[0])

    def add(self, grad_logits: torch.Tensor) -> torch.Tensor:
        """Keep the next chunk's gradient of the logits (its rows follow the last chunk's), cast to ``dtype``; the
        group's product once it is full. Returns the kept copy (valid until the next call)."""
        kept = self.stash[self.kept:self.kept + len(grad_logits)]
        kept.copy_(grad_logits)
        self.kept += len(grad_logits)
        if self.kept + len(grad_logits) > self.group_rows:
            self.flush()
        return kept

    def flush(self) -> torch.Tensor:
        """Add what is kept to the sum; the sum."""
        if self.kept:
            self.total += self.stash[:self.kept].t() @ self.inputs[self.start:self.start + self.kept]
            self.start, self.kept = self.start + self.kept, 0
        return self.total


class _LinearCrossEntropy(torch.autograd.Function):
    """forward: the mean over the counted targets (not ``ignore_index``) of the cross-entropy of ``hidden @
    weight^T``, the logits made ``chunk_rows`` rows at a time (the product in ``dtype``, the softmax's numbers in
    float32) and dropped, so they are never whole. Whole (no group), each chunk's rows are complete, so their
    gradients are made at once from the same chunk, into the hidden state's (one matmul) and the weight's (another,
    a group of chunks at a time, summed in the weight's dtype: ``_WeightGradient``), as Liger's fused linear
    cross-entropy does: backward only scales them, and nothing is made twice. Split over a group (``weight`` a
    vocabulary slice), the row max and the sum of exponentials need every rank's slice first (two all-reduces of
    per-token numbers), so backward makes each chunk's logits again; no communication there (the hidden state's
    gradient is summed over the group by ``copy_to_tp`` before it)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                group: ProcessGroup | None, ignore_index: int, chunk_rows: int, dtype: torch.dtype) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        flat_targets, local_targets, outside, chunks = _slice_targets(targets, weight.shape[0], group, chunk_rows)
        counted = flat_targets != ignore_index
        row_weight = counted.to(torch.float32) / counted.sum().clamp(min=1)  # the mean over the counted targets
        low, inputs = weight.to(dtype), flat.to(dtype)  # each cast once (none where already in dtype)
        ahead = group is None and any(ctx.needs_input_grad[:2])  # the gradients made in the forward pass
        grad_hidden = torch.empty_like(flat) if ahead else None
        grad_weight = _WeightGradient(weight, inputs, chunk_rows) if ahead else None
        every = torch.ones(len(flat), 1, dtype=torch.float32, device=flat.device)  # whole: each target is here
        scale = row_weight.unsqueeze(-1)
        row_max = torch.empty(len(flat), dtype=torch.float32, device=flat.device)
        sums = torch.empty(2, len(flat), dtype=torch.float32, device=flat.device)  # exponentials, target logit
        for rows in chunks:
            logits = F.linear(inputs[rows], low).float()
            row_max[rows] = logits.amax(dim=-1)
            logits -= row_max[rows].unsqueeze(-1)
            sums[1, rows] = logits.gather(-1, local_targets[rows].unsqueeze(-1)).squeeze(-1)
            sums[0, rows] = logits.exp_().sum(dim=-1)
            if ahead:  # exp(logit - max), made above: the softmax's numerators
                grad_logits = grad_weight.add(_softmax_gradient(logits, rows, local_targets, every, sums[0], scale))
                grad_hidden[rows] = grad_logits @ low
        if group is not None:  # each rank's sums are below its own max: rescale them below the group's
            local_max = row_max.clone()
            with group_collective(group, "loss max all-reduce"):
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            shift = local_max - row_max
            sums[0] *= shift.exp()
            sums[1] += shift
        sum_exp, target_logit = _join_slices(sums, outside, group)
        loss = ((sum_exp.log() - target_logit) * row_weight).sum()
        if ahead:
            ctx.save_for_backward(grad_hidden.view_as(hidden), grad_weight.flush())
        else:
            ctx.save_for_backward(hidden, weight, local_targets, outside, row_weight, row_max, sum_exp)
        ctx.ahead, ctx.chunks, ctx.chunk_rows, ctx.dtype = ahead, chunks, chunk_rows, dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.ahead:
            grad_hidden, grad_weight = ctx.saved_tensors  # scaled in place: no second weight-sized tensor
            return grad_hidden.mul_(grad_loss), grad_weight.mul_(grad_loss), None, None, None, None, None
        hidden, weight, local_targets, outside, row_weight, row_max, sum_exp = ctx.saved_tensors
        flat = hidden.reshape(-1, hidden.shape[-1])
        low, inputs = weight.to(ctx.dtype), flat.to(ctx.dtype)
        grad_hidden = torch.empty_like(flat)
        grad_weight = _WeightGradient(weight, inputs, ctx.chunk_rows)
        hit = (~outside).to(torch.float32).unsqueeze(-1)
        scale = (row_weight * grad_loss).unsqueeze(-1)
        for rows in ctx.chunks:
            logits = (F.linear(inputs[rows], low).float() - row_max[rows].unsqueeze(-1)).exp_()
            grad_logits = grad_weight.add(_softmax_gradient(logits, rows, local_targets, hit, sum_exp, scale))
            grad_hidden[rows] = grad_logits @ low
        return grad_hidden.view_as(hidden), grad_weight.flush(), None, None, None, None, None


class LinearCrossEntropy(nn.Module):
    """An LM head fused with its loss (``train.fused_head_loss``): called with the head's input and the targets,
    it returns their mean cross-entropy over the targets that are not ``ignore_index`` (float32; 0 when none is),
    the logits never whole (``_LinearCrossEntropy``); called with the input alone it returns it unchanged, so the
    model's own head module passes its normed hidden state on to the loss. It holds the head's weight under the head's
    name (checkpoints unchanged): whole, or a ``ColumnParallelLinear``'s vocabulary slice with its group. The
    product runs in ``dtype`` (bf16 under autocast, as the head's own would), the softmax in float32."""

    def __init__(self, weight: nn.Parameter, group: ProcessGroup | None, dtype: torch.dtype,
                 chunk_elements: int = LOSS_CHUNK_ELEMENTS) -> None:
        super().__init__()
        self.weight, self.group, self.dtype, self.chunk_elements = weight, group, dtype, chunk_elements
        self.partition_dims = {"weight": 0} if group is not None else {}

    @classmethod
    def from_head(cls, head: nn.Module, dtype: torch.dtype) -> LinearCrossEntropy:
        if getattr(head, "bias", None) is not None:
            raise LayoutError("train.fused_head_loss: the LM head has a bias; the fused loss takes a head without one")
        return cls(head.weight, getattr(head, "group", None), dtype)

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None,
                ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        if targets is None:
            return hidden
        if self.group is not None:
            hidden = copy_to_tp(hidden, self.group)
        chunk_rows = max(1, self.chunk_elements // self.weight.shape[0])
        return _LinearCrossEntropy.apply(hidden, self.weight, targets, self.group, ignore_index, chunk_rows,
                                         self.dtype)


def mean_over_counted(losses: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The mean of per-token ``losses`` over the targets that are not ``ignore_index`` (0 when none is): without
    ignored targets exactly the plain mean; no host synchronization either way."""
    counted = targets != ignore_index
    return torch.where(counted.all(), losses.mean(), losses.sum() / counted.sum().clamp(min=1))


def tp_split_dims(model: nn.Module) -> dict[str, int]:
    """Name -> dimension split over the TP group, for every tensor a tensor-parallel layer holds a shard of."""
    return {
        f"{prefix}.{name}" if prefix else name: dim
        for prefix, module in model.named_modules()
        for name, dim in getattr(module, "partition_dims", {}).items()
        if getattr(module, name) is not None
    }


def full_state_dict(model: nn.Module, group: ProcessGroup) -> dict[str, torch.Tensor]:
    """The single-device state dict of a TP model: split parameters are all-gathered (collective).

    Keys match the model before ``from_full`` swapped its layers, so a TP model can
    be compared with, or saved as, its single-device twin.
    """
    split_dims = tp_split_dims(model)
    size = dist.get_world_size(group)
    state = {}
    for key, value in model.state_dict().items():
        if key in split_dims:
            parts = [torch.empty_like(value) for _ in range(size)]
            with group_collective(group, "state all-gather"):
                dist.all_gather(parts, value.contiguous(), group=group)
            state[key] = torch.cat(parts, dim=split_dims[key])
        else:
            state[key] = value.detach().clone()
    return state
