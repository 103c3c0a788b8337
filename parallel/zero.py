"""ZeRO stages 1-3 over a data-parallel group: each replica keeps optimizer state (at 2 gradients, at 3
parameters too) for its share of the parameters.

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

Stage 3 (P_os+g+p) also shards the parameters, with the same owners as stage 2: between
steps a rank holds only its own; the others are views into one buffer per bucket
(``_Unit.full``, chunk r holding rank r's parameters) whose storage is resized to nothing
when freed and back when gathered, so autograd's saved views of them stay valid.
``ShardedParameters`` hooks the modules: a bucket is gathered (the ring's all-gather, on
the optimizer's communication thread and, on a GPU, its stream) before a module holding its
parameters runs forward, the next bucket is prefetched meanwhile, and it is freed once every
module holding it has run; before the module's backward (a hook on its outputs' gradients) it is gathered again,
the next backward bucket prefetched, and freed once its gradients are accumulated. The
gradients then go as at stage 2 and the step touches only owned parameters; nothing is
broadcast after it. The balance argument above matters more here (parameters are the
memory), so buckets are assigned largest parameter first, each starting from the loads
the earlier ones left. Whole parameters keep what stages 1 and 2 keep: checkpoints (each
owner writes its parameters), LAMB's layer norms; the price is, again, granularity.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.utils._pytree import tree_flatten

from hpc.runtime.placement import CommStream


def assign_owners(sizes: Sequence[int], ranks: int, prior: Sequence[int] = ()) -> list[int]:
    """The owning rank of each size: largest first onto the least-loaded rank (the lower on ties), counting
    the ``prior`` load earlier buckets gave it."""
    loads, owners = list(prior) or [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner = min(range(ranks), key=lambda r: loads[r])
        owners[i] = owner
        loads[owner] += sizes[i]
    return owners


class ZeroShards:
    """Who owns which parameters in ``group`` (the DP group), the owned-only step, the gather after it."""

    def __init__(
        self, params: Sequence[torch.Tensor], group: ProcessGroup, buckets: Sequence[Sequence[torch.Tensor]] = (),
        owned_first: Sequence[torch.Tensor] = (),
    ) -> None:
        """``buckets`` (stage 2): assign owners within each bucket rather than over all ``params``.
        ``owned_first``: parameters rank 0 owns whatever their size (tied copies: ``parallel.tied``)."""
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.params = list(params)
        pinned = {id(p) for p in owned_first} & {id(p) for p in self.params}
        owner_of: dict[int, int] = dict.fromkeys(pinned, 0)
        # each bucket's greedy starts from what the others gave, those with the largest first (none: a rank
        # whose parameters are all frozen)
        totals = [sum(p.numel() for p in self.params if id(p) in pinned), *[0] * (self.size - 1)]
        parts = [[p for p in part if id(p) not in pinned] for part in buckets or [self.params]]
        for part in sorted(parts, key=lambda part: -max((p.numel() for p in part), default=0)):
            owners = assign_owners([p.numel() for p in part], self.size, totals)
            owner_of.update(zip((id(p) for p in part), owners, strict=True))
            for p, owner in zip(part, owners, strict=True):
                totals[owner] += p.numel()
        self.by_owner = [[p for p in self.params if owner_of[id(p)] == r] for r in range(self.size)]
        self._owned, self._owner_of = {id(p) for p in self.by_owner[self.rank]}, owner_of

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self._owned

    def manages(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of those sharded here (not: a frozen parameter, whole on every rank)."""
        return id(param) in self._owner_of

    def owner(self, param: torch.Tensor) -> int:
        return self._owner_of[id(param)]

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

    def flatten_by_owner(self, params: Sequence[torch.Tensor], shift: int = 1) -> torch.Tensor:
        """Stage 2: one bucket's gradients as a reduce-scatter wants them: n equal chunks, chunk c holding (in
        bucket order) those of the parameters rank (c - shift) % n owns, zero-padded to the largest (the ring
        leaves rank r chunk r + 1; the backend's own reduce-scatter, chunk r)."""
        shares = [[p for p in params if self._owner_of[id(p)] == (c - shift) % self.size] for c in range(self.size)]
        length = max(sum(p.numel() for p in share) for share in shares)
        flat = params[0].grad.new_zeros(self.size * length)
        for c, share in enumerate(shares):
            offset = c * length
            for p in share:
                flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
                offset += p.numel()
        return flat

    def reduce_scatter(self, params: Sequence[torch.Tensor], average: bool) -> tuple[torch.Tensor, int]:
        """Stage 2 with nothing compressed under NCCL (parallel/optimizer.py): the backend's own reduce-scatter of
        the bucket; this rank's reduced chunk, and the bytes a ring sends for it."""
        flat = self.flatten_by_owner(params, shift=0)
        owned = flat.new_empty(flat.numel() // self.size)
        dist.reduce_scatter_tensor(owned, flat, group=self.group)
        if average:
            owned.div_(self.size)
        return owned, (self.size - 1) * owned.nbytes

    def keep_owned(self, params: Sequence[torch.Tensor], reduced: torch.Tensor | None, stream: CommStream) -> None:
        """Stage 2: this rank's gradients from its ``reduced`` chunk (None: already in place); the others' dropped,
        their memory released to ``stream``'s queued work (the reduction that reads them)."""
        offset = 0
        for p in params:
            if not self.owns(p):
                if p.grad is not None:
                    stream.release(p.grad)
                p.grad = None
            elif reduced is not None:
                p.grad.copy_(reduced[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()


FREE, PENDING, READY = "free", "pending", "ready"


class _Unit:
    """Stage 3: one bucket's parameters. ``full`` holds every rank's share (chunk r: rank r's, zero-padded); the
    parameters this rank does not own are views into it, whose memory exists only while the unit is gathered."""

    def __init__(self, index: int, params: Sequence[torch.Tensor], shards: ZeroShards) -> None:
        self.index, self.params, self.state, self.future = index, list(params), FREE, None
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            mixed = sorted(map(str, dtypes))
            raise ValueError(f"parallel.zero=3 needs one dtype per bucket; bucket{index} mixes {mixed}")
        shares = [[p for p in params if shards.owner(p) == r] for r in range(shards.size)]
        self.owned, self.length = shares[shards.rank], max(sum(p.numel() for p in share) for share in shares)
        self.full = params[0].new_zeros(shards.size * self.length)
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []  # (others' parameter, its view into ``full``)
        for r, share in enumerate(shares):
            offset = r * self.length
            for p in share:
                if r != shards.rank:
                    p.data = self.full[offset:offset + p.numel()].view_as(p)
                    self.views.append((p, p.data))
                offset += p.numel()
        self.modules: set[int] = set()  # the modules holding these parameters; those run in this forward pass
        self.forward_seen: set[int] = set()
        self.accumulated = 0  # gradients accumulated in this backward pass
        self.release()

    def allocate(self) -> None:
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())

    def release(self) -> None:
        self.full.untyped_storage().resize_(0)

    @torch.no_grad()
    def fill(self, transport) -> None:
        """Collective over the DP group: every owner's share into ``full`` (allocated), rank r's in chunk r."""
        from parallel.ring import ring_allgather

        payload = self.full.new_zeros(self.length)
        if self.owned:
            torch.cat([p.reshape(-1) for p in self.owned], out=payload[:sum(p.numel() for p in self.owned)])
        if transport.name == "mpi":  # mpi4py sees tensors through numpy, which makes their memory fixed-size
            self.full.copy_(ring_allgather(payload, transport).view(-1))
        elif transport.name == "torch" and transport.in_lockstep(payload.device):  # NCCL's own (optimizer.py)
            dist.all_gather_into_tensor(self.full.view(-1), payload, group=transport.group)
        else:
            ring_allgather(payload, transport, out=self.full.view(-1, self.length))

    def own_memory(self) -> None:
        """Others' parameters in memory of their own (not ``full``'s, which numpy would pin: a checkpoint's load)."""
        for p, view in self.views:
            p.data = torch.empty_like(view)

    def views_again(self) -> None:
        for p, view in self.views:
            p.data = view


def _holders(module: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, list[torch.Tensor]]]:
    """Each module with the parameters its own forward uses: those it holds, and those of its ParameterList and
    ParameterDict children (containers without a forward of their own). A module compiled in place
    (``train.compile``) holds all of its parameters: the hooks then run around its graph, not inside it, where
    each would break the graph at every module they sit on. ``nn.Module.compile`` compiles the call that runs the
    module's hooks too, so the hooks are kept out of the compiler (``torch.compiler.disable``): else, where the
    gather is NCCL's own collective, torch.compile traced it into the block's graph (one more graph, 30 more
    operations in the test's GPT), against the design above."""
    containers = (torch.nn.ParameterList, torch.nn.ParameterDict)
    compiled = [m for m in module.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    inside = {id(sub) for m in compiled for sub in m.modules() if sub is not m}
    for m in module.modules():
        if id(m) in inside or isinstance(m, containers):
            continue
        if m in compiled:
            yield m, list(m.parameters())
            continue
        params = list(m.parameters(recurse=False))
        for child in m.children():
            params += list(child.parameters()) if isinstance(child, containers) else []
        yield m, params


class ShardedParameters:
    """Stage 3 over the DP group: the hooks that gather each bucket's parameters (``_Unit``) just before a module
    holding them runs forward, and again before its backward, prefetching the next bucket meanwhile, and free them
    once every module holding them has run forward, and once all their gradients are accumulated in backward.

    Gathers run on ``executor`` (the optimizer's communication thread, in the order submitted, the same on every
    rank) so a prefetch overlaps computation; without one they run inline. On a GPU they run on ``stream`` (the
    optimizer's communication stream) after an event the compute stream recorded when the gather was asked for,
    and the compute stream, not the host, waits for each one's end before a module uses it. A parameter must be
    used only inside the forward of a module holding it directly or through a ParameterList/ParameterDict (as FSDP
    asks): elsewhere its memory may be gone.
    """

    def __init__(self, shards: ZeroShards, buckets: Sequence[Sequence[torch.Tensor]], module: torch.nn.Module,
                 transport, executor: Executor | None, stream: CommStream, probe, peers: Sequence[int]) -> None:
        self.shards, self.transport, self.executor, self.probe, self.peers = shards, transport, executor, probe, peers
        self.stream = stream
        self.units = [_Unit(i, params, shards) for i, params in enumerate(buckets)]
        unit_of = {id(p): unit for unit in self.units for p in unit.params}
        self._handles = []
        for m, params in _holders(module):
            units = sorted({unit_of[id(p)].index for p in params if id(p) in unit_of})
            if units:
                for i in units:
                    self.units[i].modules.add(id(m))
                self._handles.append(m.register_forward_pre_hook(functools.partial(self._before_forward, units)))
                self._handles.append(m.register_forward_hook(functools.partial(self._after_forward, units)))
        for unit in self.units:
            for p in unit.params:
                self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, unit)))

    @torch.compiler.disable
    def _before_forward(self, units: list[int], module: torch.nn.Module, args) -> None:
        for i in units:
            self.wait(i)
        self.prefetch(units[0] - 1)  # buckets run in reverse registration order, forward in about registration order

    @torch.compiler.disable
    def _after_forward(self, units: list[int], module: torch.nn.Module, args, output) -> None:
        for i in units:
            unit = self.units[i]
            unit.forward_seen.add(id(module))
            if unit.forward_seen >= unit.modules:
                unit.forward_seen.clear()
                if i != 0 or not torch.is_grad_enabled():  # bucket 0, which backward needs first, stays gathered
                    self.free(i)
        if torch.is_grad_enabled():
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(functools.partial(self._before_backward, units))

    @torch.compiler.disable
    def _before_backward(self, units: list[int], grad: torch.Tensor) -> None:
        for i in units:
            self.wait(i)
        self.prefetch(units[-1] + 1)

    def _accumulated(self, unit: _Unit, param: torch.Tensor) -> None:
        unit.accumulated += 1
        if unit.accumulated == len(unit.params):
            unit.accumulated = 0
            self.free(unit.index)

    def _gather(self, unit: _Unit) -> None:
        with self.probe.collective(f"all-gather bucket{unit.index}", "zero", self.peers,
                                   bytes=unit.full.numel() * unit.full.element_size()):
            unit.fill(self.transport)

    def _start(self, unit: _Unit) -> None:
        unit.allocate()
        if self.executor is None:
            self._gather(unit)
            unit.state = READY
        else:  # the memory (and the owned parameters the step updated) ready on the compute stream first
            unit.future, unit.state = self.executor.submit(self._gather_on_stream, unit, self.stream.ready()), PENDING

    def _gather_on_stream(self, unit: _Unit, ready: object | None) -> object | None:
        """On the communication thread: the gather on the communication stream once ``ready`` passed; the event
        that marks its end there (None on a CPU)."""
        with self.stream.after(ready):
            self._gather(unit)
            return self.stream.ready()

    def prefetch(self, i: int) -> None:
        if 0 <= i < len(self.units) and self.units[i].state == FREE and self.executor is not None:
            self._start(self.units[i])

    def wait(self, i: int) -> None:
        """Bucket ``i`` gathered: started now if it was free, waited for if in flight."""
        unit = self.units[i]
        if unit.state == FREE:
            self._start(unit)
        if unit.state == PENDING:
            future: Future = unit.future
            unit.future = None
            self.stream.join(future.result())  # on a GPU the compute stream waits for this gather, not the host
            unit.state = READY

    def free(self, i: int) -> None:
        unit = self.units[i]
        if unit.state == PENDING:
            self.wait(i)
        if unit.state == READY:
            unit.release()
            unit.state = FREE

    def free_all(self) -> None:
        """Every bucket freed (end of a step: prefetched but unused ones too); their counters reset."""
        for unit in self.units:
            self.free(unit.index)
            unit.forward_seen.clear()
            unit.accumulated = 0

    @contextlib.contextmanager
    def allocated(self) -> Iterator[None]:
        """Memory for every parameter, not gathered (a checkpoint is loaded into it, then the others' dropped)."""
        self.free_all()
        for unit in self.units:
            unit.own_memory()
        try:
            yield
        finally:
            for unit in self.units:
                unit.views_again()

    @torch.no_grad()
    def unshard(self) -> None:
        """Collective: every rank keeps every parameter again, in memory of its own, and the hooks go (end of
        training: the model is whole for evaluation and whoever uses it next)."""
        self.remove_hooks()
        for unit in self.units:
            self.wait(unit.index)
            for p in unit.params:
                if not self.shards.owns(p):
                    p.data = p.detach().clone()
            unit.release()
            unit.state = FREE
        self.units = []

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
