"""What every gradient codec and reducer shares: the interfaces, error feedback, bucket flattening.

Horovod compresses only to fp16, and quantized codecs elsewhere fall back to
all-gather because quantized values cannot be summed as they travel. Because we
own the ring, a hop decodes what it receives, adds its own contribution in full
precision, and re-encodes the partial sum for the next hop; in the all-gather the
owner encodes the final chunk once and it is forwarded unchanged, so every rank
decodes identical bytes and ends with identical values.

Each codec states its wire ratio (bytes sent / float32 bytes) and its error bound
per encode; a ring of n ranks encodes each element n times (n-1 partial sums and
the final value), and with error feedback those errors are returned to the next
step rather than lost (see ``ErrorFeedback``).

A reducer owns what must persist between steps for its codec: the error-feedback
residuals (per rank, per bucket) and PowerSGD's warm-start matrices. Both are state
a resumed run needs, hence ``state_dict``/``load_state_dict`` with plain tensors
keyed by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from parallel.transport import Transport


class Codec:
    """Identity: send the tensor as it is. Codecs applied at every ring hop override these methods."""

    name = "none"
    lossy = False

    def wire_ratio(self, dtype: torch.dtype = torch.float32) -> float:
        return 1.0

    def encode(self, chunk: torch.Tensor) -> torch.Tensor:
        return chunk

    def decode(self, payload: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return payload

    def add_decoded(self, payload: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """``into += decode(payload)``: what a reduce-scatter hop does; codecs may fuse it."""
        return into.add_(self.decode(payload, into))

    def decode_into(self, payload: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """``into[:] = decode(payload)``: what an all-gather hop does; codecs may skip the temporary."""
        return into.copy_(self.decode(payload, into))

    def encode_keeping_error(self, chunk: torch.Tensor, error: torch.Tensor, final: bool) -> torch.Tensor:
        """``encode(chunk)``, adding what it lost to ``error`` (``chunk - decoded``) and, when ``final``, leaving
        ``chunk`` what the others decode: a ring hop with error feedback; codecs may fuse it."""
        payload = self.encode(chunk)
        decoded = self.decode(payload, chunk)
        error.add_(chunk - decoded)
        if final:
            chunk.copy_(decoded)
        return payload

    def empty_payload(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(like)

    def error_bound(self, chunk: torch.Tensor) -> torch.Tensor:
        """Largest absolute error one encode of ``chunk`` may introduce, per element."""
        return torch.zeros_like(chunk)


@dataclass
class ErrorFeedback:
    """Residuals per tensor: what compression took from a step is added back to the next.

    The ring reports, per rank, exactly the error its own encodes introduced, and
    the sum over ranks of those errors is the step's total error; adding them back
    keeps the running sum of decoded results within one step's error of the truth.
    """

    residuals: dict[str, torch.Tensor] = field(default_factory=dict)

    def compensate(self, key: str, flat: torch.Tensor) -> None:
        residual = self.residuals.get(key)
        if residual is not None:
            flat.add_(residual)

    def store(self, key: str, error: torch.Tensor) -> None:
        self.residuals[key] = error

    def reusable(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """A zeroed buffer for this step's error: last step's residual once ``compensate`` consumed it."""
        residual = self.residuals.get(key)
        return residual.zero_() if residual is not None else torch.zeros_like(like)

    def residual(self, key: str, like: torch.Tensor) -> torch.Tensor:
        """The residual buffer itself, zeros at first, for a codec that adds the new gradient into it
        and keeps there what it did not send."""
        residual = self.residuals.get(key)
        if residual is None:
            self.residuals[key] = residual = torch.zeros_like(like)
        return residual


class Reducer(ABC):
    """How a bucket of gradients is summed across the data-parallel group, and the state that takes."""

    name: str
    supports_reduce_scatter = False  # ring codecs: ``reduce_scatter(key, flat, transport, average)`` (ZeRO stage 2)
    whole_tensors = False  # compresses each tensor as a matrix (PowerSGD): a flat shard would cut them
    nodes = 1  # the nodes the exchange is cut by (parallel/hierarchy.py), whose shards its state is of

    @abstractmethod
    def reduce(self, key: str, tensors: Sequence[torch.Tensor], transport: Transport, average: bool) -> int:
        """Sum (or average) ``tensors`` across the group in place; returns the bytes this rank sent."""

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def momentum_correction(self, optimizer: torch.optim.Optimizer) -> MomentumCorrection | None:
        """The optimizer's momentum, taken over to be applied before the reduction (top-k does);
        None leaves the optimizer's momentum where it is."""
        return None


class WithErrorFeedback(Reducer):
    """Reducers whose codec is lossy keep the residuals of each bucket (or matrix) here."""

    def __init__(self) -> None:
        self.feedback = ErrorFeedback()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"residual/{k}": v for k, v in self.feedback.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.feedback.residuals = {
            k.removeprefix("residual/"): v.clone() for k, v in state.items() if k.startswith("residual/")
        }


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-D tensor over ``tensors``: a view when they lie back to back in one buffer (a single contiguous
    tensor, or the optimizer's bucket views), reduced in place; else a copy."""
    if _back_to_back(tensors):
        return tensors[0].as_strided((sum(t.numel() for t in tensors),), (1,))
    return torch.cat([t.reshape(-1) for t in tensors])


def _back_to_back(tensors: Sequence[torch.Tensor]) -> bool:
    first = tensors[0]
    end = first.data_ptr()
    for tensor in tensors:
        if (not tensor.is_contiguous() or tensor.dtype != first.dtype or tensor.data_ptr() != end
                or tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return False
        end += tensor.numel() * tensor.element_size()
    return True


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    if flat.data_ptr() == tensors[0].data_ptr() and _back_to_back(tensors):
        return  # flatten's view: already in place
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def ring_bytes(numel_bytes: float, n: int) -> int:
    """What one rank sends in a ring all-reduce of ``numel_bytes`` over ``n`` ranks: 2 (n-1)/n of it."""
    return int(2 * (n - 1) / n * numel_bytes)


class MomentumCorrection:
    """Deep Gradient Compression's momentum correction: sparsify the velocity, not the gradient.

    With heavy-ball SGD, error feedback on gradients lets a coordinate's delayed
    mass arrive in bursts that momentum then amplifies (the demo's loss at 1%
    top-k: 0.071 against 0.039). Moving the momentum in front of the reduction
    (u = m u + g per rank, then top-k of u plus its residual, applied by plain
    SGD) sends the same total displacement without the amplification. With an
    exact reduction this is momentum SGD itself, so warm-up steps are unchanged.
    The velocity is per rank, state a resumed run needs.
    """

    def __init__(self, momentum: float):
        self.momentum = momentum
        self.velocity: dict[str, torch.Tensor] = {}

    @classmethod
    def take_from(cls, optimizer: torch.optim.Optimizer) -> MomentumCorrection | None:
        """The optimizer's momentum, which it stops applying itself; None if it is not plain SGD.

        Only plain SGD qualifies (no Nesterov, dampening or weight decay, which act
        on the gradient before momentum); any other optimizer keeps its own.
        """
        groups = optimizer.param_groups
        if not isinstance(optimizer, torch.optim.SGD) or not all(
            g["momentum"] > 0 and not g["nesterov"] and g["dampening"] == 0 and g["weight_decay"] == 0
            and g["momentum"] == groups[0]["momentum"] for g in groups
        ):
            return None
        momentum = groups[0]["momentum"]
        for group in groups:
            group["momentum"] = 0.0
        return cls(momentum)

    def apply(self, bucket_key: str, grads: Sequence[torch.Tensor]) -> None:
        """``grads`` become this rank's velocities, u = m u + g, before they are reduced."""
        for i, grad in enumerate(grads):
            key = f"velocity/{bucket_key}/{i}"
            if key in self.velocity:
                grad.add_(self.velocity[key], alpha=self.momentum)
            self.velocity[key] = grad.clone()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.velocity)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.velocity = {k: v.clone() for k, v in state.items() if k.startswith("velocity/")}
