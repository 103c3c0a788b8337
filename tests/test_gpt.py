"""The single-device GPT, the licenses byte corpus and the GPT layout checks."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hpc.config import load_spec, spec_from_dict
from hpc.errors import ConfigError, LayoutError
from hpc.runtime.mesh import MeshShape
from jobs.data.datasets import (
    LICENSES_DIR,
    ByteWindows,
    byte_windows,
    dp_shard,
    load_licenses,
    window_starts,
)
from jobs.models.gpt import build_gpt, lm_loss
from jobs.train.layout import check_job_layout
from jobs.train.workloads import fetch

EXAMPLE = Path(__file__).resolve().parents[1] / "jobs" / "examples" / "gpt.toml"
TINY = spec_from_dict({"model": {"kind": "gpt", "n_layers": 2, "n_heads": 4, "d_model": 32, "seq_len": 32}}).model


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny matmuls on shared cores: a second thread only waits for the first (25 s instead of 1 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_seed_alone_decides_the_weights() -> None:
    torch.manual_seed(123)
    first = build_gpt(TINY, seed=1).state_dict()
    torch.manual_seed(456)
    again = build_gpt(TINY, seed=1).state_dict()
    other = build_gpt(TINY, seed=2).state_dict()
    for name, value in first.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=0)
    assert not torch.equal(other["blocks.0.attention.qkv.weight"], first["blocks.0.attention.qkv.weight"])


def test_a_byte_only_influences_the_logits_after_it() -> None:
    model = build_gpt(TINY, seed=0).eval()
    ids = torch.randint(0, 256, (2, TINY.seq_len), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 10] = (ids[:, 10] + 1) % 256
    with torch.no_grad():
        before, after = model(ids), model(changed)
    assert before.shape == (2, TINY.seq_len, 256)
    torch.testing.assert_close(after[:, :10], before[:, :10], rtol=0, atol=0)
    assert not torch.allclose(after[:, 10:], before[:, 10:])


def test_a_sequence_longer_than_the_positions_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than seq_len=32"):
        build_gpt(TINY, seed=0)(torch.zeros(1, TINY.seq_len + 1, dtype=torch.long))


def test_the_tiny_gpt_learns_the_held_out_text() -> None:
    torch.manual_seed(0)
    model = build_gpt(TINY, seed=0)
    corpus = load_licenses()
    held_out = fetch(ByteWindows(corpus.test, TINY.seq_len, stride=TINY.seq_len), range(200))

    def held_out_loss() -> float:
        with torch.no_grad():
            return lm_loss(model(held_out[0]), held_out[1]).item()

    initial = held_out_loss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(30):
        starts = window_starts(len(corpus.train), batch_size=16, seq_len=TINY.seq_len, seed=0, step=step)
        inputs, targets = byte_windows(corpus.train, starts, TINY.seq_len)
        loss = lm_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert initial == pytest.approx(math.log(256), rel=0.01)  # near-uniform at the start
    assert held_out_loss() < initial - 1.0


def test_logits_past_the_chunk_size_get_the_same_loss_without_a_float32_copy() -> None:
    """Logits larger than ``TORCH_LOSS_ELEMENTS`` (bf16, 2 x 2048 tokens x 1100 vocabulary) are not copied to
    float32 whole: the loss and its gradient are torch's on the float32 copy all the same."""
    from jobs.models.gpt import TORCH_LOSS_ELEMENTS
    from tests.test_tensor_parallel import _logit_sized

    torch.manual_seed(0)
    logits = (torch.randn(2, 2048, 1100) * 3).bfloat16().requires_grad_()
    assert logits.numel() > TORCH_LOSS_ELEMENTS
    targets = torch.randint(0, 1100, (2, 2048))
    loss = {}
    assert _logit_sized(lambda: loss.update(ours=lm_loss(logits, targets)), logits.numel()) == 0
    expected = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss["ours"], expected, rtol=1e-6, atol=0)
    ours, theirs = torch.autograd.grad(loss["ours"], logits)[0], torch.autograd.grad(expected, logits)[0]
    torch.testing.assert_close(ours, theirs, rtol=2**-7, atol=1e-9)


def test_licenses_corpus_is_every_regular_file_in_name_order_with_each_tail_held_out(tmp_path) -> None:
    texts = {"b": b"0123456789" * 3, "a": b"abcdefghij"}
    for name, text in texts.items():
        (tmp_path / name).write_bytes(text)
    (tmp_path / "c").symlink_to(tmp_path / "a")
    corpus = load_licenses(tmp_path, test_fraction=0.1)
    assert bytes(corpus.train.tolist()) == b"abcdefghi" + b"0123456789" * 2 + b"0123456"
    assert bytes(corpus.test.tolist()) == b"j" + b"789"


def test_the_real_licenses_corpus() -> None:
    corpus = load_licenses()
    regular = [p for p in LICENSES_DIR.iterdir() if p.is_file() and not p.is_symlink()]
    assert len(corpus.train) + len(corpus.test) == sum(p.stat().st_size for p in regular)
    assert len(corpus.train) > 150_000 and len(corpus.test) > 15_000
    assert corpus.train.dtype == torch.uint8


def test_missing_license_texts_are_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="base-files"):
        load_licenses(tmp_path)


def test_windows_are_pure_in_seed_and_step_and_targets_are_the_next_bytes() -> None:
    data = torch.arange(200, dtype=torch.uint8)
    starts = window_starts(len(data), batch_size=64, seq_len=16, seed=3, step=7)
    np.testing.assert_array_equal(starts, window_starts(200, 64, 16, seed=3, step=7))
    assert not np.array_equal(starts, window_starts(200, 64, 16, seed=3, step=8))
    assert starts.min() >= 0 and starts.max() <= 200 - 17
    inputs, targets = byte_windows(data, starts, 16)
    assert inputs.shape == targets.shape == (64, 16) and inputs.dtype == torch.long
    np.testing.assert_array_equal(inputs[:, 0].numpy(), starts)
    torch.testing.assert_close(targets, inputs + 1)
    shards = [dp_shard(starts, r, 4) for r in range(4)]
    np.testing.assert_array_equal(np.concatenate(shards), starts)


def test_a_window_longer_than_the_text_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"model.seq_len=16 is longer than the text \(16 bytes\)"):
        window_starts(16, batch_size=1, seq_len=16, seed=0, step=0)


def test_held_out_windows_predict_every_byte_once() -> None:
    held_out = ByteWindows(torch.arange(100, dtype=torch.uint8), 16, stride=16)
    _, targets = fetch(held_out, range(len(held_out)))
    np.testing.assert_array_equal(targets.flatten().numpy(), np.arange(1, 1 + targets.numel()))
    assert 100 - 1 - targets.numel() < 16  # only a tail shorter than one window is left out


def test_example_spec_loads_and_fits_its_layout() -> None:
    spec = load_spec(EXAMPLE)
    assert (spec.model.kind, spec.data.name) == ("gpt", "licenses")
    check_job_layout(spec, MeshShape(dp=1, tp=spec.parallel.tp, pp=spec.parallel.pp))


@pytest.mark.parametrize(
    ("model", "tp", "pp", "virtual", "message"),
    [
        ({"n_heads": 6, "d_model": 96}, 4, 1, 1, "model.n_heads=6 is not divisible by parallel.tp=4"),
        ({"n_heads": 3, "d_model": 96}, 3, 1, 1, "the vocabulary of 256 tokens is not divisible by parallel.tp=3"),
        ({"n_layers": 6}, 1, 4, 1, "model.n_layers=6 is not divisible by parallel.pp * virtual stages = 4*1 = 4"),
        ({"n_layers": 4}, 1, 2, 3, "model.n_layers=4 is not divisible by parallel.pp * virtual stages = 2*3 = 6"),
    ],
)
def test_a_layout_that_does_not_cut_the_gpt_is_refused(model, tp, pp, virtual, message) -> None:
    spec = spec_from_dict({"model": {"kind": "gpt", **model}, "data": {"name": "licenses", "batch_size": 8},
                           "parallel": {"virtual_stages": virtual}})
    with pytest.raises(LayoutError, match="^" + re.escape(message)):
        check_job_layout(spec, MeshShape(dp=1, tp=tp, pp=pp))


def test_layouts_that_cut_the_gpt_pass() -> None:
    for tp, pp, virtual in [(1, 1, 1), (2, 2, 2), (8, 4, 2), (4, 8, 1)]:
        spec = spec_from_dict({"model": {"kind": "gpt", "n_layers": 8, "n_heads": 8, "d_model": 64},
                               "data": {"name": "licenses", "batch_size": 8 * pp},
                               "parallel": {"virtual_stages": virtual, "microbatches": pp * 2, "schedule":
                                            "interleaved" if virtual > 1 else "1f1b"}})
        check_job_layout(spec, MeshShape(dp=1, tp=tp, pp=pp))
