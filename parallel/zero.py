"""ZeRO stages 1 and 2 over a data-parallel group: each replica keeps optimizer state (and, at 2, gradients)
for its share of the parameters.

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

Stage 2 (P_os+g) also shards the gradients: each bucket of ``parallel/optimizer.py`` goes
through the ring's reduce-scatter phase alone (``parallel/ring.py``, with the codec and
its error feedback) instead of the whole all-reduce, and each rank keeps only the
gradients of what it owns. The ring's chunk c ends whole on rank (c - 1) % n, so the
bucket is laid out by owner: chunk c holds rank (c - 1) % n's parameters, zero-padded to
the largest share. Owners are therefore assigned per bucket (the same greedy rule), which
keeps every chunk near 1/n of its bucket; a bucket of one parameter (one larger than
``bucket_mb``) is all one rank's and its reduce-scatter sends (n - 1) times its size, as
much as the all-reduce at dp = 2 and more beyond: the price of whole-parameter shards.
Slicing parameters at ring-chunk boundaries would remove it but split optimizer state
and LAMB's layer norms across ranks. top-k and PowerSGD reduce in ways of their own
(all-gather, power iteration): under stage 2 they all-reduce as before and then drop the
gradients other ranks own, so their memory is stage 2's after the reduction but their
traffic is stage 1's.
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

    def __init__(
        self, params: Sequence[torch.Tensor], group: ProcessGroup, buckets: Sequence[Sequence[torch.Tensor]] = (),
    ) -> None:
        """``buckets`` (stage 2): assign owners within each bucket rather than over all ``params``."""
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.params = list(params)
        owner_of: dict[int, int] = {}
        for part in buckets or [self.params]:
            owners = assign_owners([p.numel() for p in part], self.size)
            owner_of.update(zip((id(p) for p in part), owners, strict=True))
        self.by_owner = [[p for p in self.params if owner_of[id(p)] == r] for r in range(self.size)]
        self._owned, self._owner_of = {id(p) for p in self.by_owner[self.rank]}, owner_of

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

    def flatten_by_owner(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """Stage 2: one bucket's gradients as the ring's reduce-scatter wants them: n equal chunks, chunk c
        holding (in bucket order) those of the parameters rank (c - 1) % n owns, zero-padded to the largest."""
        shares = [[p for p in params if self._owner_of[id(p)] == (c - 1) % self.size] for c in range(self.size)]
        length = max(sum(p.numel() for p in share) for share in shares)
        flat = params[0].grad.new_zeros(self.size * length)
        for c, share in enumerate(shares):
            offset = c * length
            for p in share:
                flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
                offset += p.numel()
        return flat

    def keep_owned(self, params: Sequence[torch.Tensor], reduced: torch.Tensor | None) -> None:
        """Stage 2: this rank's gradients from its ``reduced`` chunk (None: already in place); the others' dropped."""
        offset = 0
        for p in params:
            if not self.owns(p):
                p.grad = None
            elif reduced is not None:
                p.grad.copy_(reduced[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
