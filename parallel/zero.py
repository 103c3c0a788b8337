"""ZeRO stage 1 over a data-parallel group: each replica keeps optimizer state for its share of the parameters.

Why: every DP replica holding Adam's two moments for every parameter is 8 of the 16 bytes
per parameter of fp32 training; sharding them over the dp replicas of a (tp, pp)
coordinate leaves 8/dp (Rajbhandari et al. 2020, stage 1, P_os), as Megatron's
distributed optimizer does per TP and PP rank. Gradients are all-reduced as before (the
ring and its codec, ``parallel/optimizer.py``); each rank then steps only the parameters
it owns: the wrapped optimizer sees the others' gradients as None, so a torch optimizer
(or ``parallel/large_batch.py``'s) neither updates them nor creates state for them; then
every owner broadcasts its updated parameters to the other replicas, dp broadcasts of
about 1/dp of the parameters each, an all-gather.

Shards are whole parameters, assigned greedily by size (largest first onto the least
loaded rank, ties to the lower rank), not slices of the flattened parameters: a
parameter's state stays one tensor shaped like it, placed in a checkpoint exactly as
without ZeRO (its owner writes it; the index shows whole tensors, loadable under any
dp and stage), and LAMB's and LARS's layer norms need no reduction over DP. The price
is balance: a rank's share exceeds 1/dp by at most the largest parameter. The
assignment depends only on the sizes, which are the same on every TP rank of a stage,
so TP peers own the same layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def assign_owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """The owning rank of each size: largest first onto the least-loaded rank (the lower on ties)."""
    loads, owners = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner = min(range(ranks), key=lambda r: loads[r])
        owners[i] = owner
        loads[owner] += sizes[i]
    return owners


class ZeroShards:
    """Who owns which parameters in ``group`` (the DP group), the owned-only step, the gather after it."""

    def __init__(self, params: Sequence[torch.Tensor], group: ProcessGroup) -> None:
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        owners = assign_owners([p.numel() for p in params], self.size)
        self.params = list(params)
        self.by_owner = [[p for p, o in zip(params, owners, strict=True) if o == r] for r in range(self.size)]
        self._owned = {id(p) for p in self.by_owner[self.rank]}

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self._owned

    @contextlib.contextmanager
    def owned_gradients_only(self) -> Iterator[None]:
        """Hide the gradients of the parameters other ranks own (the optimizer skips them), then put them back."""
        hidden = {}
        for param in self.params:
            if param.grad is not None and not self.owns(param):
                hidden[param], param.grad = param.grad, None
        try:
            yield
        finally:
            for param, grad in hidden.items():
                param.grad = grad

    @torch.no_grad()
    def gather_parameters(self) -> int:
        """Collective over the group: each owner broadcasts its parameters, flattened per dtype, in owner order.
        Returns the bytes this rank received."""
        received = 0
        if self.size == 1:
            return received
        for owner, params in enumerate(self.by_owner):
            for dtype in sorted({p.dtype for p in params}, key=str):
                same = [p for p in params if p.dtype == dtype]
                if owner == self.rank:
                    flat = torch.cat([p.reshape(-1) for p in same])
                else:
                    flat = torch.empty(sum(p.numel() for p in same), dtype=dtype, device=same[0].device)
                dist.broadcast(flat, group=self.group, group_src=owner)
                if owner != self.rank:
                    received += flat.nbytes
                    offset = 0
                    for p in same:
                        p.copy_(flat[offset:offset + p.numel()].view_as(p))
                        offset += p.numel()
        return received
