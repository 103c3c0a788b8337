"""Codecs without processes: round trips stay within their documented bound; sizes match the wire ratio."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc.config import CODEC_NAMES
from parallel.compression.base import Codec, ErrorFeedback
from parallel.compression.registry import REGISTRY, RING_CODECS, make_codec


@pytest.mark.parametrize("name", RING_CODECS)
@pytest.mark.parametrize("numel", [1, 255, 256, 1000, 4099])
def test_round_trip_within_bound(name, numel) -> None:
    torch.manual_seed(numel)
    codec = make_codec(name)
    x = torch.randn(numel) * 10
    payload = codec.encode(x)
    decoded = codec.decode(payload, x)
    assert decoded.shape == x.shape and decoded.dtype == x.dtype
    assert torch.all((decoded - x).abs() <= codec.error_bound(x))
    if not codec.lossy:
        assert torch.equal(decoded, x)


@pytest.mark.parametrize("name", RING_CODECS)
def test_payload_size_matches_wire_ratio(name) -> None:
    codec = make_codec(name)
    x = torch.randn(256 * 40)
    payload = codec.encode(x)
    assert payload.numel() * payload.element_size() == pytest.approx(x.numel() * 4 * codec.wire_ratio())
    empty = codec.empty_payload(x)
    assert (empty.numel(), empty.dtype) == (payload.numel(), payload.dtype)


def test_int8_wire_ratio_and_zero_blocks() -> None:
    codec = make_codec("int8")
    assert codec.wire_ratio() == pytest.approx(0.2539, abs=1e-4)
    zeros = torch.zeros(300)
    assert torch.equal(codec.decode(codec.encode(zeros), zeros), zeros)


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(st.floats(-1e4, 1e4, allow_nan=False, allow_subnormal=False), min_size=1, max_size=600),
    name=st.sampled_from(["fp16", "bf16", "int8"]),
)
def test_error_bound_holds_for_any_input(values, name) -> None:
    codec = make_codec(name)
    x = torch.tensor(values, dtype=torch.float32)
    decoded = codec.decode(codec.encode(x), x)
    assert torch.all((decoded - x).abs() <= codec.error_bound(x))


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=300),
    final=st.booleans(),
)
def test_int8_fused_error_keeping_equals_encode_decode_subtract(values, final) -> None:
    """int8's one-pass encode keeping the error (whole blocks on the CPU) against Codec's encode, decode and
    subtract: the same payload, error and final values bit for bit, subnormals and zeros of either sign too."""
    codec = make_codec("int8")
    x = torch.tensor(values, dtype=torch.float32).repeat(-(-512 // len(values)))[:512]  # two whole blocks
    x[::7] = 0.0
    x[1::11] = -0.0
    error = torch.linspace(-1, 1, x.numel())
    fused_x, fused_error = x.clone(), error.clone()
    fused = codec.encode_keeping_error(fused_x, fused_error, final)
    plain = Codec.encode_keeping_error(codec, x, error, final)
    assert torch.equal(fused, plain)
    assert torch.equal(fused_error.view(torch.int32), error.view(torch.int32))
    assert torch.equal(fused_x.view(torch.int32), x.view(torch.int32))


def test_error_feedback_adds_the_residual_back() -> None:
    feedback = ErrorFeedback()
    flat = torch.ones(4)
    feedback.compensate("w", flat)
    assert torch.equal(flat, torch.ones(4))
    feedback.store("w", torch.full((4,), 0.5))
    feedback.compensate("w", flat)
    assert torch.equal(flat, torch.full((4,), 1.5))


def test_unknown_codec() -> None:
    with pytest.raises(ValueError, match="unknown ring codec 'int4'"):
        make_codec("int4")


def test_the_registry_implements_exactly_the_codec_names_of_the_job_spec() -> None:
    """hpc/config.py names the codecs (the spec validates without torch); the registry implements them,
    in the same order, so that error messages list them alike."""
    assert tuple(REGISTRY) == CODEC_NAMES
    assert set(RING_CODECS) < set(CODEC_NAMES)


def test_the_planner_charges_each_codec_the_wire_ratio_it_reports() -> None:
    """parallel/compression/wire.py is the one table: every codec's own ratio, for float32 and bf16 gradients."""
    from parallel.compression.powersgd import PowerSGD
    from parallel.compression.topk import TopK
    from parallel.compression.wire import wire_ratio

    for dtype in (torch.float32, torch.bfloat16):
        for name in RING_CODECS:
            assert wire_ratio(name, dtype.itemsize) == make_codec(name).wire_ratio(dtype), name
        assert wire_ratio("topk", dtype.itemsize, topk_fraction=0.05) == TopK(0.05).wire_ratio(dtype)
    for shape in ((64, 64), (3, 5), (1024, 16)):
        ratio = wire_ratio("powersgd", powersgd_rank=4, matrix=shape)
        assert ratio == PowerSGD(4).wire_ratio_for(torch.Size(shape))
    assert set(CODEC_NAMES) == {*RING_CODECS, "topk", "powersgd"}


@settings(max_examples=20, deadline=None)
@given(numel=st.integers(1, 300_000), fraction=st.sampled_from([0.001, 0.01, 0.1]), seed=st.integers(0, 100))
def test_topk_selection_is_exact(numel, fraction, seed) -> None:
    """The sampled fast path picks the same set of magnitudes as torch.topk."""
    from parallel.compression.topk import TopK

    generator = torch.Generator().manual_seed(seed)
    flat = torch.randn(numel, generator=generator) * torch.rand(numel, generator=generator) ** 4
    codec = TopK(fraction)
    picked = flat.abs()[codec.top_indices(flat)].sort().values
    expected = flat.abs().topk(codec.k(numel)).values.sort().values
    assert torch.equal(picked, expected)
    decoded = codec.add_decoded(codec.encode(flat), torch.zeros_like(flat))
    assert torch.all((decoded - flat).abs() <= codec.error_bound(flat))


@settings(max_examples=20, deadline=None)
@given(numel=st.integers(1, 300_000), seed=st.integers(0, 100),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_topk_adds_the_gradient_into_the_residual_while_selecting(numel, seed, dtype) -> None:
    """The fused pass (numpy in blocks; torch for bfloat16) leaves residual + gradient behind and
    picks that sum's k largest magnitudes."""
    from parallel.compression.topk import TopK

    generator = torch.Generator().manual_seed(seed)
    residual = torch.randn(numel, generator=generator).to(dtype)
    gradient = torch.randn(numel, generator=generator).to(dtype)
    total = residual + gradient
    codec = TopK(0.01)
    picked = codec.top_indices(residual, plus=gradient)
    assert torch.equal(residual, total)
    assert torch.equal(total.abs()[picked].sort().values, total.abs().topk(codec.k(numel)).values.sort().values)


def test_flatten_is_a_view_of_tensors_back_to_back_in_one_buffer_else_a_copy() -> None:
    from parallel.compression.base import flatten, unflatten_into

    flat = torch.arange(10.0)
    parts = [flat[:4].view(2, 2), flat[4:10]]
    view = flatten(parts)
    assert view.data_ptr() == flat.data_ptr() and view.numel() == 10
    view.mul_(2)
    unflatten_into(view, parts)  # nothing to copy: already in place
    assert torch.equal(flat, torch.arange(10.0) * 2)
    gapped = [flat[:4], flat[5:]]
    copy = flatten(gapped)
    assert copy.data_ptr() != flat.data_ptr() and copy.numel() == 9
    copy.zero_()
    unflatten_into(copy, gapped)
    assert flat[4] == 8 and flat[:4].eq(0).all() and flat[5:].eq(0).all()
