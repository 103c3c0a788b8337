"""The ring codecs' fused Triton kernels (``parallel.compression.kernels``) give the torch path's results bit for bit.

On CPU, Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess so that no other test
sees interpreted kernels) runs the kernels on CPU tensors; skipped without Triton. On a GPU
(``-m cuda``) every codec's CUDA results equal its CPU results, and top-k and PowerSGD run
without stopping the host for the device.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from parallel.compression import host_kernels, kernels
from parallel.compression.casts import CastCodec
from parallel.compression.int8 import Int8Codec
from parallel.compression.powersgd import PowerSGDReducer
from parallel.compression.topk import TopK

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1, 255, 256, 1000, 3 * 4096, 3 * 4096 + 300)  # one value, short blocks, whole blocks, several programs, ragged


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _gradient(n: int, seed: int) -> torch.Tensor:
    """Values across magnitudes, and a zero block (its scale is float32's tiny)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n).pow(torch.rand(n, generator=g))
    x[: min(n, 256)] = 0.0 if n > 512 else x[: min(n, 256)]
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def interpreter_fuses_fma() -> bool:
    """Whether Triton's interpreter rounds ``tl.fma`` once, as the GPU does (Triton 3.6's, torch 2.11's, multiplies
    and then adds: two roundings). For a = 1 + 2^-23, a * a is 1 + 2^-22 + 2^-46: fma(a, a, -(1 + 2^-22)) keeps the
    2^-46, rounding the product first loses it."""
    import triton
    import triton.language as tl

    @triton.jit
    def product_residual(a_ptr, c_ptr, out_ptr):
        lanes = tl.arange(0, 2)
        a = tl.load(a_ptr + lanes)
        tl.store(out_ptr + lanes, tl.fma(a, a, tl.load(c_ptr + lanes)))

    out = torch.zeros(2)
    product_residual[(1,)](torch.full((2,), 1.0 + 2.0**-23), torch.full((2,), -(1.0 + 2.0**-22)), out)
    return out[0].item() == 2.0**-46


def fused_adds_agree() -> bool:
    """Whether the kernel's fused add and the torch path's may be compared bit for bit here: both round once."""
    return interpreter_fuses_fma() and host_kernels.addcmul_fuses()  # the torch path's add: see there


def check_kernels_on_cpu() -> None:
    """The kernels, called directly on CPU tensors (under the interpreter), against the torch path. int8's add
    only where the interpreter's ``fma`` and this CPU's ``addcmul_`` both round once, as the GPU does
    (``pytest -m cuda`` checks it on a GPU)."""
    codec, into_seed = Int8Codec(), 99
    fused = fused_adds_agree()
    for n in SIZES:
        x = _gradient(n, n)
        expected = codec.encode(x)
        payload = torch.full_like(expected, 7)
        scales, values = codec._split(payload, n)
        kernels.int8_encode(x, scales, values, codec.block)
        assert torch.equal(payload, expected), f"int8 encode, {n} values"
        decoded = torch.full_like(x, float("nan"))
        kernels.int8_decode(scales, values, decoded, codec.block, add=False)
        assert torch.equal(_bits(decoded), _bits(codec.decode(expected, x))), f"int8 decode, {n} values"
        into = _gradient(n, into_seed)
        summed = into.clone()
        kernels.int8_decode(scales, values, summed, codec.block, add=True)
        assert not fused or torch.equal(_bits(summed), _bits(codec.add_decoded(expected, into.clone()))), \
            f"int8 add, {n}"
    for name in ("fp16", "bf16"):
        cast = CastCodec(name)
        for n in SIZES:
            x = _gradient(n, n)
            payload = cast.empty_payload(x)
            kernels.cast(x, payload)
            assert torch.equal(_bits(payload), _bits(cast.encode(x))), f"{name} encode, {n} values"
            decoded = torch.full_like(x, float("nan"))
            kernels.cast(payload, decoded)
            assert torch.equal(_bits(decoded), _bits(cast.decode(payload, x))), f"{name} decode, {n} values"
            into = _gradient(n, into_seed)
            summed = into.clone()
            kernels.cast(payload, summed, add=True)
            assert torch.equal(_bits(summed), _bits(cast.add_decoded(payload, into.clone()))), f"{name} add, {n}"


@pytest.mark.skipif(not _triton_importable(), reason="needs triton (its interpreter runs the kernels on CPU)")
def test_kernels_equal_torch_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    code = "from tests.test_codec_kernels import check_kernels_on_cpu; check_kernels_on_cpu(); print('ok')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-4000:]


SPECIAL_N = 2 * 256 + 100  # two whole int8 blocks and a ragged one: a NaN or inf must stay in its own block
PATTERNS = ("nan", "inf", "-inf", "mix", "zero", "overflow")
SPECIAL = {  # pattern: {index: value}, written over finite gradients (block 1, at 256-511, keeps finite values
    "nan": {3: math.nan, 600: math.nan},  # but for "mix" and "overflow")
    "inf": {5: math.inf, 610: math.inf},
    "-inf": {5: -math.inf, 511: 1e-3, 605: -math.inf},
    "mix": {3: math.nan, 4: math.inf, 5: -math.inf, 300: math.inf, 301: -math.inf, 600: math.nan, 601: math.inf},
    "zero": {**dict.fromkeys(range(256), 0.0), **dict.fromkeys(range(512, SPECIAL_N), 0.0), 7: -0.0, 520: -0.0},
    "overflow": {7: 1e5, 8: -7e4, 9: 65520.0, 10: 65519.0, 300: torch.finfo(torch.float32).max, 301: -3.4e38,
                 600: 1e38, 601: -65536.0},  # fp16 is inf past 65504 (65520 rounds up), bf16 past float32's max
}


def _special(pattern: str, seed: int) -> torch.Tensor:
    """``SPECIAL_N`` finite gradients across magnitudes with ``pattern``'s values written in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SPECIAL_N, generator=g) * torch.logspace(-3, 3, SPECIAL_N).pow(torch.rand(SPECIAL_N, generator=g))
    for index, value in SPECIAL.get(pattern, {}).items():
        x[(index + 17 * seed) % SPECIAL_N if seed > 1 else index] = value
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, but a NaN equals any NaN (its sign and payload are the device's: the GPU writes
    0x7FFFFFFF where x86 writes 0xFFC00000)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(_bits(a[~nan]), _bits(b[~nan]))


def _torch_ops(codec) -> tuple[Callable, Callable, Callable, Callable]:
    """The codec's own encode, decode, add and encode keeping the error: torch on CPU tensors (int8's error
    kept in one fused pass where the blocks are whole), the kernels on CUDA tensors."""
    return codec.encode, codec.decode, codec.add_decoded, codec.encode_keeping_error


def _kernel_ops(codec) -> tuple[Callable, Callable, Callable, Callable]:
    """The kernels called directly (under the interpreter, on CPU tensors), as the codec calls them on CUDA."""
    if isinstance(codec, Int8Codec):
        def encode(x):
            payload = torch.full_like(codec.empty_payload(x), 7)
            kernels.int8_encode(x, *codec._split(payload, x.numel()), codec.block)
            return payload

        def decode_into(payload, into, add):
            kernels.int8_decode(*codec._split(payload, into.numel()), into, codec.block, add=add)
            return into
    else:
        def encode(x):
            payload = codec.empty_payload(x)
            kernels.cast(x, payload)
            return payload

        def decode_into(payload, into, add):
            kernels.cast(payload, into, add=add)
            return into
    def decode(payload, like):
        return decode_into(payload, torch.full_like(like, 7.0), False)

    def encode_keeping_error(segment, error, final):  # Codec's: encode, decode, error += segment - decoded
        payload = encode(segment)
        decoded = decode(payload, segment)
        error.add_(segment - decoded)
        if final:
            segment.copy_(decoded)
        return payload
    return encode, decode, lambda payload, into: decode_into(payload, into, True), encode_keeping_error


def _chain(codec, ops, pattern: str, feedback: bool, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """One ring hop's encode and decode of ``pattern``; with ``feedback`` the ring's encodes keeping the error
    (``error += segment - decoded``; the owner's final one leaves it the decoded values) on segments as the ring
    cuts them, whole blocks then the ragged rest, and the next step, which encodes a gradient plus that
    residual; without, the decoded payload added into a received segment that holds the pattern too."""
    encode, decode, add, encode_keeping_error = ops
    x = _special(pattern, 1).to(device)
    payload = encode(x)
    results = [*_payload_parts(codec, payload, x.numel()), ("decoded", decode(payload, x))]
    if feedback:
        cuts = ((0, SPECIAL_N - SPECIAL_N % 256), (SPECIAL_N - SPECIAL_N % 256, SPECIAL_N))
        error, final = torch.zeros_like(x), x.clone()
        payloads = [encode_keeping_error(final[a:b], error[a:b], True) for a, b in cuts]
        compensated = _special("", 2).to(device) + error
        error_2 = torch.zeros_like(x)
        payloads += [encode_keeping_error(compensated[a:b], error_2[a:b], False) for a, b in cuts]
        for (a, b), cut_payload in zip(cuts * 2, payloads, strict=True):
            results += _payload_parts(codec, cut_payload, b - a)
        results += [("error", error), ("final", final), ("error 2", error_2)]
    else:
        results.append(("added", add(payload, _special(pattern, 2).to(device))))
    return [(name, t.cpu()) for name, t in results]


def _payload_parts(codec, payload: torch.Tensor, n: int) -> list[tuple[str, torch.Tensor]]:
    if isinstance(codec, Int8Codec):
        scales, values = codec._split(payload, n)
        return [("scales", scales), ("values", values)]
    return [("payload", payload)]


def _codec(name: str):
    return Int8Codec() if name == "int8" else CastCodec(name)


def _non_finite(t: torch.Tensor) -> torch.Tensor:
    return torch.stack([t.isnan(), t.isposinf(), t.isneginf()])


def _differences(got: list[tuple[str, torch.Tensor]], expected: list[tuple[str, torch.Tensor]],
                 loose: tuple[str, ...] = ()) -> str:
    """The first stage whose tensors differ, with the first differing values; '' when all are the same. The
    stages in ``loose`` need only hold NaN and inf in the same places."""
    for (name, a), (_, b) in zip(got, expected, strict=True):
        if name in loose and torch.equal(_non_finite(a), _non_finite(b)):
            continue
        if not _same(a, b):
            bad = (a.isnan() != b.isnan()) | ((a != b) & ~a.isnan()) if a.is_floating_point() else a != b
            at = bad.nonzero().flatten()[:4].tolist()
            return f"{name} differs at {at}: {a[at].tolist()} against {b[at].tolist()}"
    return ""


def check_special_values_on_cpu() -> dict[str, str]:
    """Every codec x pattern x error feedback under the interpreter against the torch path: case -> '' or the
    first difference. int8's fused add only by where it holds NaN and inf if the interpreter's ``fma`` or this
    CPU's ``addcmul_`` rounds twice (Triton 3.6's; ``ATEN_CPU_CAPABILITY=default``)."""
    results, fused = {}, fused_adds_agree()
    for name in ("int8", "fp16", "bf16"):
        codec = _codec(name)
        loose = ("added",) if name == "int8" and not fused else ()
        for pattern in PATTERNS:
            for feedback in (False, True):
                expected = _chain(codec, _torch_ops(codec), pattern, feedback)
                got = _chain(codec, _kernel_ops(codec), pattern, feedback)
                results[f"{name}-{pattern}-{feedback}"] = _differences(got, expected, loose)
    return results


@pytest.fixture(scope="module")
def interpreted_special_values() -> dict[str, str]:
    if not _triton_importable():
        pytest.skip("needs triton (its interpreter runs the kernels on CPU)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    code = ("import json; from tests.test_codec_kernels import check_special_values_on_cpu; "
            "print(json.dumps(check_special_values_on_cpu()))")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("name", ["int8", "fp16", "bf16"])
def test_kernels_keep_nan_and_inf_under_the_interpreter(interpreted_special_values, name, pattern, feedback) -> None:
    """A NaN or inf in a block: the kernels' scales, values, decoded sums and error buffers are the torch
    path's (int8: a block holding a NaN has a NaN scale and decodes all NaN, one holding an inf an inf scale
    and decodes all NaN; fp16: past 65504 is inf; NaN stays NaN)."""
    assert interpreted_special_values[f"{name}-{pattern}-{feedback}"] == ""


@pytest.mark.cuda
@pytest.mark.parametrize("feedback", [False, True], ids=["plain", "feedback"])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("name", ["int8", "fp16", "bf16"])
def test_cuda_kernels_keep_nan_and_inf(name: str, pattern: str, feedback: bool) -> None:
    codec = _codec(name)
    if _triton_importable():
        assert kernels.available(torch.zeros(4, device="cuda")), "Triton imports but the kernels do not dispatch"
    expected = _chain(codec, _torch_ops(codec), pattern, feedback)
    assert _differences(_chain(codec, _torch_ops(codec), pattern, feedback, device="cuda"), expected) == ""
    assert not kernels._failed, kernels._failed


def test_cpu_tensors_stay_on_torch() -> None:
    """The dispatch: CPU tensors never reach Triton, so the CPU path is unchanged."""
    assert not kernels.available(torch.zeros(4))


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["int8", "fp16", "bf16"])
def test_cuda_ring_codecs_equal_cpu(name: str) -> None:
    if _triton_importable():
        assert kernels.available(torch.zeros(4, device="cuda")), "Triton imports but the kernels do not dispatch"
    codec = Int8Codec() if name == "int8" else CastCodec(name)
    for n in (*SIZES, 1 << 20, (1 << 22) + 77):
        x = _gradient(n, n)
        into = _gradient(n, 5)
        payload = codec.encode(x)
        gpu_payload = codec.encode(x.cuda())
        assert torch.equal(_bits(gpu_payload.cpu()), _bits(payload)), f"{name} encode, {n} values"
        gpu_decoded = codec.decode_into(gpu_payload, torch.full_like(x, float("nan"), device="cuda"))
        assert torch.equal(_bits(gpu_decoded.cpu()), _bits(codec.decode(payload, x))), f"{name} decode, {n}"
        assert torch.equal(_bits(codec.decode(gpu_payload, x.cuda()).cpu()), _bits(gpu_decoded.cpu()))
        gpu_summed = codec.add_decoded(gpu_payload, into.cuda())
        assert torch.equal(_bits(gpu_summed.cpu()), _bits(codec.add_decoded(payload, into))), f"{name} add, {n}"
    assert not kernels._failed, kernels._failed


def _synced(steps: dict[str, Callable[[], object]]) -> list[str]:
    """The names of the steps that made the host wait for the device (torch's sync debug mode)."""
    synced = []
    for name, step in steps.items():
        step()  # once first: compilation and first allocations may synchronize
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        except RuntimeError as exc:
            synced.append(f"{name}: {exc}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return synced


@pytest.mark.cuda
def test_cuda_topk_selects_the_cpu_set_without_host_sync() -> None:
    topk = TopK(0.01)
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3))
    residual = torch.randn(1 << 20, generator=torch.Generator().manual_seed(4))
    expected = topk.top_indices(x.clone(), plus=residual.clone())
    gx, gres = x.cuda(), residual.cuda()
    chosen = topk.top_indices(gx.clone(), plus=gres)
    assert torch.equal(chosen.sort().values.cpu(), expected.sort().values)
    into = torch.zeros_like(gx)
    payload = topk.encode(gx.clone())
    assert _synced({
        "select": lambda: topk.top_indices(gx.clone(), plus=gres),
        "pack": lambda: topk.encode(gx.clone()),
        "add_decoded": lambda: topk.add_decoded(payload, into),
    }) == []


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_cuda_powersgd_equals_cpu_without_host_sync(one_rank) -> None:
    from parallel.transport import TorchTransport

    transport = TorchTransport()
    grads = [torch.randn(256, 128, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    cpu, gpu = PowerSGDReducer(4), PowerSGDReducer(4)
    cpu.reduce("b", [g.clone() for g in grads], transport, average=False)
    gpu_grads = [g.cuda() for g in grads]
    gpu.reduce("b", gpu_grads, transport, average=False)
    for name, q in cpu.qs.items():
        assert gpu.qs[name].is_cuda
        torch.testing.assert_close(gpu.qs[name].cpu(), q, rtol=1e-3, atol=1e-4)  # QR and matmuls differ by rounding
    assert _synced({"reduce": lambda: gpu.reduce("b", gpu_grads, transport, average=False)}) == []


def test_bench_codecs_rows(capsys) -> None:
    """``hpc bench codecs`` on the CPU: a copy row, then one per codec, with the columns the table prints."""
    import json

    from hpc.cli.main import main
    from jobs.bench.codecs import CODECS, COLUMNS, format_table

    assert main(["bench", "codecs", "--sizes", "64K", "--iters", "1", "--warmup", "0", "--device", "cpu",
                 "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["codec"] for r in rows] == ["copy", *CODECS]
    assert all(tuple(r) == COLUMNS and r["bytes"] == 64 << 10 and r["GBps"] > 0 for r in rows)
    assert rows[0]["vs_copy"] == 1.0 and rows[CODECS.index("topk") + 1]["decode_ms"] is None
    assert len(format_table(rows).splitlines()) == len(rows) + 1
    assert main(["bench", "codecs", "--codecs", "int4"]) == 2
