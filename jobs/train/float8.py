"""``train.float8``: the blocks' matmuls in Float8 through torchao's float8 training.

torchao's ``convert_to_float8_training`` (the library torchtitan uses) swaps ``nn.Linear`` for ``Float8Linear``:
dynamic scales per tensor (``tensorwise``) or per row (``rowwise``), ``torch._scaled_mm`` underneath, traced
whole by ``torch.compile``, bf16 masters and gradients outside the matmul. We write our own only what torchao
cannot know: which layers (the Linears of the model's pipeline blocks, the LM head and MoE routers left in
bf16 as torchtitan leaves its output layer; both sides multiples of 16, ``_scaled_mm``'s rule), our TP layers'
local products (``parallel.tensor_parallel``'s shards go through the same Float8 matmul, their collectives
unchanged), and one line refusing hardware without FP8 before anything trains. torchao is optional
(``pip install 'hpc-batch[float8]'``); it is imported only when the key is set.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
from torch import nn

from hpc.errors import ConfigError
from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores
MATMUL_MULTIPLE = 16  # torch._scaled_mm needs both sides of the weight to be multiples of 16
KEPT_HIGH = ("lm_head", "router")  # last name components left in bf16: the logits and the experts' choice


def float8_refusal(recipe: str, device: torch.device) -> str | None:
    """Why ``train.float8 = recipe`` cannot run on ``device`` (one line), or None."""
    key = f"train.float8={recipe!r}"
    if device.type != "cuda":
        return (f"{key}: Float8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, "
                f"Blackwell); this run computes on the {device.type.upper()} (set train.float8='off')")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return (f"{key}: {torch.cuda.get_device_name(device)} is compute capability {capability[0]}.{capability[1]}; "
                "Float8 matmuls need 8.9 or newer (Ada, Hopper, Blackwell) (set train.float8='off')")
    if importlib.util.find_spec("torchao") is None:
        return f"{key} needs torchao: pip install 'hpc-batch[float8]' (or torchao)"
    return None


def _eligible(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and all(size % MATMUL_MULTIPLE == 0 for size in weight.shape)


def _kept_high(name: str) -> bool:
    return name.rpartition(".")[2] in KEPT_HIGH


class Float8Product:
    """``F.linear``'s signature through torchao's Float8 matmul, for a TP layer's shard: the same autograd
    Function ``Float8Linear.forward`` applies, with the same config, on the weight it is given."""

    def __init__(self, config) -> None:
        from torchao.float8.float8_linear import Float8Linear

        with torch.device("meta"):
            template = Float8Linear.from_float(nn.Linear(MATMUL_MULTIPLE, MATMUL_MULTIPLE, bias=False), config=config)
        self.config, self.mm_config = template.config, template.linear_mm_config

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        if torch.is_autocast_enabled():
            x = x.to(torch.get_autocast_gpu_dtype())
        y = matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)
        return y if bias is None else y + bias.to(y.dtype)


def apply_float8(blocks: list[nn.Module], recipe: str, device: torch.device, emulate: bool = False) -> int:
    """Convert the eligible Linears of ``blocks`` (this rank's pipeline blocks; the whole model when it has
    none) to Float8 training with torchao's ``recipe``, in place; how many. Refuses in one line
    (``float8_refusal``) where FP8 cannot run, unless ``emulate`` (torchao's emulation: the same casts and
    scales, the product in high precision; what the CPU tests run)."""
    refusal = None if emulate else float8_refusal(recipe, device)
    if refusal:
        raise ConfigError(refusal)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    product: Float8Product | None = None
    converted = 0

    def eligible(module: nn.Module, name: str) -> bool:
        nonlocal converted
        take = isinstance(module, nn.Linear) and not _kept_high(name) and _eligible(module.weight)
        converted += take
        return take

    for block in blocks:
        convert_to_float8_training(block, module_filter_fn=eligible, config=config)
        for name, module in block.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and not _kept_high(name) \
                    and _eligible(module.weight):
                product = product or Float8Product(config)
                module.product = product
                converted += 1
    return converted
