"""A model built on the meta device, materialized shard by shard with the values of its host build.

A seeded model's values depend on every draw its build makes, in order: the default
inits its construction runs (torch's ``reset_parameters``) and the initialization the
model runs after it (the GPT's own generator, transformers' ``_init_weights``). So a
rank that keeps only its TP/PP/EP share must still make every draw. While
``build_on_meta`` builds the model on the meta device, a dispatch mode records each
draw from the default generator, and each initialization the model defers through
``run_init``: the module, the function, and the tensors the module held then.

``Replay.materialize`` replays that record on the host after ``torch.manual_seed(job.seed)``,
once the share has been cut on meta (TP layers holding meta shards, the rest ``Elsewhere``):
a draw is made into a scratch tensor and dropped; an init runs on full host tensors swapped
into its module, one module at a time, and each tensor this rank holds (by its single-device
name) is then sliced to the rank's TP shard, moved to the device, and the full tensor dropped.
Host memory while building: the rank's share plus one module's full tensors, not the whole
model. The global generator ends where the host build leaves it (dropout draws on from there).

A pretrained model (``jobs.models.hf`` with ``pretrained = DIR``) carries ``stored_weights``
(``jobs.models.pretrained``):
``materialize`` reads each tensor of the share from its files instead, the rank's TP slice alone, straight
into the device tensor; only the inits of the tensors the files do not hold (non-persistent buffers: rotary
``inv_freq``) run, and no draw is replayed (its host build draws nothing either: the generator stays at the seed).

A model opts in by deferring every tensor's initialization to ``run_init`` (the built-in
MLP and GPT, and ``jobs.models.hf``'s transformers models do); any other model is built whole on the
host as before. ``NotReplayable`` says the record cannot give the host build's values (an init
that touches a tensor its module did not hold, a held float tensor no init wrote, a non-float
tensor, a draw whose count depends on tensor values): the caller then builds on the host.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from jobs.models.protocol import build_model
from parallel.tensor_parallel import tp_split_dims

if TYPE_CHECKING:
    from hpc.config import JobSpec

InitStep = tuple[nn.Module, Callable[[nn.Module], None]]
TRANSIENT_MMAP_BYTES = 1 << 20  # a transient host tensor this large gets a mapping of its own


class NotReplayable(Exception):
    """The record of a meta build cannot reproduce its host build's values; build on the host."""


@dataclass(frozen=True)
class _Shape:
    """A tensor of a recorded draw, replayed as a scratch host tensor of the same layout."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def scratch(self) -> torch.Tensor:
        return transient(self.size, self.stride, self.dtype)


@dataclass
class _Draw:
    """A random op on the default generator: replayed into scratch tensors, its values dropped."""

    func: Any
    args: tuple
    kwargs: dict

    def replay(self) -> None:
        unshape = lambda x: x.scratch() if isinstance(x, _Shape) else x  # noqa: E731
        kwargs = {k: (torch.device("cpu") if k == "device" and v is not None and torch.device(v).type == "meta"
                      else unshape(v)) for k, v in self.kwargs.items()}
        self.func(*map(unshape, self.args), **kwargs)


@dataclass
class _Init:
    """One module's deferred initialization, with the tensors the module held when it was recorded."""

    module: nn.Module
    init: Callable[[nn.Module], None]
    tensors: list[tuple[str, bool, torch.Tensor]]  # (attribute, is a parameter, the tensor then)


class _Recorder(TorchDispatchMode):
    """Records the draws from the default generator (and ``run_init``'s inits) of a build."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[_Draw | _Init] = []
        self.unreplayable = ""  # why not, once a draw cannot be replayed
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (torch.Tag.nondeterministic_seeded in func.tags and kwargs.get("generator") is None
                and not self.paused):
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A draw is replayable when it reads no tensor: it fills ``args[0]`` (or ``out``) in place, or makes
        a new one. One that reads a tensor (bernoulli with tensor probabilities, multinomial) may draw a count
        of numbers that depends on the tensor's values."""
        written = [args[0]] if args and isinstance(args[0], torch.Tensor) and func._schema.name.endswith("_") else []
        written += [kwargs["out"]] if isinstance(kwargs.get("out"), torch.Tensor) else []
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, torch.Tensor) and not any(x is w for w in written):
                self.unreplayable = self.unreplayable or f"{func} reads a tensor"
        shape = lambda x: (_Shape(tuple(x.shape), tuple(x.stride()), x.dtype)  # noqa: E731
                           if isinstance(x, torch.Tensor) else x)
        self.events.append(_Draw(func, tree_map(shape, args), tree_map(shape, kwargs)))


class _NoMeta(TorchDispatchMode):
    """Refuses any op on a meta tensor: an init that reaches beyond the tensors its module held when recorded."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(x, torch.Tensor) and x.is_meta for x in tree_flatten((args, kwargs))[0]):
            raise NotReplayable(f"the init of {self.where} uses a tensor it did not hold ({func})")
        return func(*args, **kwargs)


_RECORDING: list[_Recorder] = []


def recording() -> bool:
    """Whether a meta build is being recorded (``run_init`` then records instead of running), and not paused."""
    return bool(_RECORDING) and not _RECORDING[-1].paused


def run_init(steps: Iterable[InitStep]) -> None:
    """Run a model's initialization, ``(module, init)`` in order, each init setting the module's own tensors;
    while ``build_on_meta`` records, record it instead, to be replayed module by module at materialization."""
    if recording():
        for module, init in steps:
            tensors = [(name, True, t) for name, t in module._parameters.items() if t is not None]
            tensors += [(name, False, t) for name, t in module._buffers.items() if t is not None]
            _RECORDING[-1].events.append(_Init(module, init, tensors))
        return
    with torch.no_grad():
        for module, init in steps:
            init(module)


@contextlib.contextmanager
def _recorded() -> Iterator[_Recorder]:
    recorder = _Recorder()
    _RECORDING.append(recorder)
    try:
        with recorder:
            yield recorder
    finally:
        _RECORDING.pop()


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Draws made meanwhile are not recorded (they do not belong to the model's build)."""
    recorder = _RECORDING[-1] if _RECORDING else None
    if recorder is None:
        yield
        return
    before, recorder.paused = recorder.paused, True
    try:
        yield
    finally:
        recorder.paused = before


def uninitialized(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` without its default init's draws (built on meta, unrecorded), then given uninitialized memory
    on the default device: for a module whose construction would draw what its deferred init draws again."""
    device = torch.get_default_device()
    with unrecorded(), torch.device("meta"):
        module = build()
    return module.to_empty(device=device)


def build_on_meta(spec: JobSpec) -> tuple[nn.Module, Replay | None]:
    """The spec's model on the meta device with its replay; else (a model that does not defer every tensor's
    init to ``run_init``, or cannot be built on meta) the whole model on the host, as
    ``jobs.models.protocol.build_model`` builds it, and None."""
    try:
        with _recorded() as recorder, torch.device("meta"):
            model = build_model(spec)
    except Exception:  # the host build raises what is wrong, if anything is
        return build_model(spec), None
    replay = Replay(model, recorder.events, spec.job.seed)
    if not replay.covers_model() or recorder.unreplayable:
        return build_model(spec), None
    return model, replay


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by each of its names (a tied weight under both)."""
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **{name: t for name, t in model.named_buffers(remove_duplicate=False) if t is not None}}


class Replay:
    """The record of one meta build (see the module docstring)."""

    def __init__(self, model: nn.Module, events: list[_Draw | _Init], seed: int) -> None:
        self.events, self.seed = events, seed
        self.names: dict[int, list[str]] = {}  # id of a tensor of the built model -> its single-device names
        self.kept = list(named_tensors(model).values())  # alive while the ids above are used
        for name, tensor in named_tensors(model).items():
            self.names.setdefault(id(tensor), []).append(name)
        self.last_init: dict[int, int] = {}  # id of a recorded tensor -> the index of the last init holding it
        for index, event in enumerate(events):
            for _, _, tensor in event.tensors if isinstance(event, _Init) else ():
                self.last_init[id(tensor)] = index

    def covers_model(self) -> bool:
        """Whether some deferred init held every tensor of the built model."""
        return bool(self.names) and all(key in self.last_init for key in self.names)

    def materialize(self, share: nn.Module, device: torch.device, tp_rank: int = 0) -> None:
        """Give every meta tensor of ``share`` (the model with its share cut) its value on ``device``:
        the host build's, sliced to ``tp_rank``'s shard where a TP layer holds one. A pretrained model's
        (``share.stored_weights``, ``jobs.models.pretrained``) tensors are read from its files, each shard's slice
        alone; only the inits of what the files do not hold (rotary ``inv_freq``) run, and nothing is drawn."""
        targets = {name: t for name, t in named_tensors(share).items() if t.is_meta}
        placed = _Placement(targets, tp_split_dims(share), tp_rank, device)
        stored = getattr(share, "stored_weights", None)
        for name in targets if stored is not None else ():
            placed.read(name, stored)
        left = {name for name, t in targets.items() if id(t) not in placed.placed}
        held = {key for key, names in self.names.items() if any(name in left for name in names)}
        host: dict[int, torch.Tensor] = {}
        torch.manual_seed(self.seed)
        with torch.no_grad():
            for index, event in enumerate(self.events):
                if isinstance(event, _Draw):
                    if stored is None:
                        event.replay()
                    continue
                if stored is not None and not any(id(t) in held for _, _, t in event.tensors):
                    continue  # its tensors came from the files (or are not this rank's)
                _run(event, host, held)
                for _, _, tensor in event.tensors:
                    if self.last_init[id(tensor)] == index and id(tensor) in host:
                        full = host.pop(id(tensor))
                        for name in self.names.get(id(tensor), []) if id(tensor) in held else []:
                            placed.place(name, full)
        placed.swap_into(share)


def transient(size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized host tensor that lives briefly: a large one in an anonymous mapping of its own, unmapped
    when it is dropped. From malloc, the full tensors of one module after another would stay in its heap,
    fragmented by whatever small allocation lands between them: a rank's resident peak measured 66 MiB for a
    share of 48.5 MiB and tensors of at most 4 MiB (tp=4), 52.6 MiB this way."""
    extent = 1 + sum((n - 1) * step for n, step in zip(size, stride, strict=True)) if all(size) else 0
    nbytes = extent * dtype.itemsize
    if nbytes < TRANSIENT_MMAP_BYTES:
        return torch.empty_strided(size, stride, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buffer, dtype=dtype, count=extent).as_strided(size, stride)


def _fresh(tensor: torch.Tensor, held: bool) -> torch.Tensor:
    """A full host tensor for a recorded one: NaN where this rank keeps it (an init must overwrite every
    element), uninitialized where its values are only drawn and dropped."""
    full = transient(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
    if held:
        if not tensor.is_floating_point():
            raise NotReplayable(f"a {tensor.dtype} tensor cannot be checked for being initialized")
        full.fill_(math.nan)
    return full


def _run(event: _Init, host: dict[int, torch.Tensor], held: set[int]) -> None:
    """One recorded init on host tensors swapped into its module (then swapped back out)."""
    module, saved = event.module, []
    for attr, is_param, tensor in event.tensors:
        full = host.get(id(tensor))
        if full is None:
            full = host[id(tensor)] = _fresh(tensor, id(tensor) in held)
        table = module._parameters if is_param else module._buffers
        saved.append((table, attr, table.get(attr), attr in table))
        table[attr] = nn.Parameter(full, requires_grad=tensor.requires_grad) if is_param else full
    try:
        with _NoMeta(type(module).__name__):
            event.init(module)
    finally:
        for table, attr, before, present in reversed(saved):
            if present:
                table[attr] = before
            else:
                del table[attr]


class _Placement:
    """This rank's materialized tensors, by the meta tensor of the share they replace. All are allocated on the
    device first, before any full host tensor is made: on the host, the transient full tensors then come and go
    above the share instead of fragmenting the heap between its tensors."""

    def __init__(self, targets: dict[str, torch.Tensor], split_dims: dict[str, int], tp_rank: int,
                 device: torch.device) -> None:
        self.targets, self.split_dims, self.tp_rank = targets, split_dims, tp_rank
        self.values = {id(t): torch.empty(t.shape, dtype=t.dtype, device=device) for t in targets.values()}
        self.placed: set[int] = set()

    def read(self, name: str, stored: Any) -> None:
        """``name``'s shard from a pretrained model's files (``stored.read``: its slice alone), where they hold it."""
        target = self.targets[name]
        if id(target) in self.placed:
            return
        dim = self.split_dims.get(name)
        index = tuple(slice(self.tp_rank * size, (self.tp_rank + 1) * size) if d == dim else slice(None)
                      for d, size in enumerate(target.shape))
        shard = stored.read(name, index)
        if shard is None:
            return
        if tuple(shard.shape) != tuple(target.shape):
            raise NotReplayable(f"{name}: the share holds {tuple(target.shape)}, the files gave {tuple(shard.shape)}")
        self.values[id(target)].copy_(shard)  # to the device, widened to the model's dtype on the way
        self.placed.add(id(target))

    def place(self, name: str, full: torch.Tensor) -> None:
        target = self.targets.get(name)
        if target is None or id(target) in self.placed:
            return
        dim = self.split_dims.get(name)
        shard = full if dim is None else full.narrow(dim, self.tp_rank * target.shape[dim], target.shape[dim])
        if shard.shape != target.shape or shard.dtype != target.dtype:
            raise NotReplayable(f"{name}: the share holds {tuple(target.shape)} {target.dtype}, "
                                f"the build made {tuple(full.shape)} {full.dtype}")
        if torch.isnan(shard.sum()):  # NaN where no init wrote (a sum: no temporary the size of the tensor)
            raise NotReplayable(f"{name}: no deferred init set all of it (its value came from construction)")
        self.values[id(target)].copy_(shard)
        self.placed.add(id(target))

    def swap_into(self, share: nn.Module) -> None:
        """Replace every meta tensor of ``share`` by its value, in every module holding it (tied weights too)."""
        missing = [name for name, t in self.targets.items() if id(t) not in self.placed]
        if missing:
            raise NotReplayable(f"{missing[0]} is set by no deferred init")
        new = {id(t): _like_parameter(t, self.values[id(t)]) if isinstance(t, nn.Parameter) else self.values[id(t)]
               for t in self.targets.values()}
        for module in share.modules():
            for table in (module._parameters, module._buffers):
                for key, tensor in table.items():
                    if tensor is not None and id(tensor) in new:
                        table[key] = new[id(tensor)]


def _like_parameter(meta: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    """A parameter holding ``value`` with what was set on the meta one: requires_grad, gradient hooks
    (``replicated_with_grad_allreduce``'s sum over TP), other attributes."""
    param = nn.Parameter(value, requires_grad=meta.requires_grad)
    for hook in (meta._backward_hooks or {}).values():
        param.register_hook(hook)
    for hook in (getattr(meta, "_post_accumulate_grad_hooks", None) or {}).values():
        param.register_post_accumulate_grad_hook(hook)
    param.__dict__.update({k: v for k, v in meta.__dict__.items() if k not in param.__dict__})
    return param
