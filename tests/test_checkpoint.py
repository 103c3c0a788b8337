"""Sharded HDF5 checkpoints: the write plan, round trips, atomic publishing, damage detection, the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc.checkpoint.discovery import find_latest, list_checkpoints, read_latest, resolve_resume
from hpc.checkpoint.format import CheckpointError, read_index
from hpc.checkpoint.pieces import PieceMeta, plan_writes
from hpc.cli.main import main
from tests.ranks import run_ranks

# --- the write plan (pure) ---------------------------------------------------------------


@st.composite
def replicated_layouts(draw):
    """Tensors split along dim 0 over ``tp`` columns and replicated over ``dp`` rows of ranks."""
    dp, tp = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    tensors = draw(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5)), min_size=1, max_size=8))
    per_rank: list[list[PieceMeta]] = [[] for _ in range(dp * tp)]
    for index, (rows_per_part, cols) in enumerate(tensors):
        global_shape = (rows_per_part * tp, cols)
        for rank in range(dp * tp):
            column = rank % tp
            per_rank[rank].append(
                PieceMeta(f"t{index}", "float32", global_shape, (column * rows_per_part, 0), (rows_per_part, cols))
            )
    return dp, tp, per_rank


@given(replicated_layouts())
def test_plan_writes_every_piece_once_by_a_holder_and_balances_replicas(layout) -> None:
    dp, tp, per_rank = layout
    plan = plan_writes(per_rank)
    holders = {}
    for rank, pieces in enumerate(per_rank):
        for meta in pieces:
            holders.setdefault(meta.key, set()).add(rank)
    assert set(plan.writers) == set(holders)
    assert all(plan.writers[key] in holders[key] for key in holders)
    sizes = {meta.key: meta.nbytes for pieces in per_rank for meta in pieces}
    for column in range(tp):
        ranks = range(column, dp * tp, tp)  # the DP replicas of one TP column hold the same pieces
        loads = [sum(sizes[k] for k in plan.written_by(r)) for r in ranks]
        assert max(loads) - min(loads) <= max(sizes.values())
    for record in plan.tensors:
        assert sum(np.prod(p.shape) for p in record.pieces) == np.prod(record.shape)


def _meta(name, global_shape, offsets, shape, dtype="float32"):
    return PieceMeta(name, dtype, global_shape, offsets, shape)


@pytest.mark.parametrize(
    ("per_rank", "message"),
    [
        ([[_meta("w", (4,), (0,), (2,))], [_meta("w", (4,), (1,), (2,))]], "overlap"),
        ([[_meta("w", (4,), (0,), (2,))], []], "cover 2 of its 4 elements"),
        ([[_meta("w", (4,), (0,), (4,))], [_meta("w", (4,), (0,), (4,), "float64")]], "hold the same piece"),
        ([[_meta("w", (4,), (0,), (2,))], [_meta("w", (6,), (2,), (2,))]], "disagree on the tensor"),
        ([[_meta("a", (1,), (0,), (1,)), _meta("a/b", (1,), (0,), (1,))]], "collide"),
    ],
)
def test_plan_rejects_inconsistent_pieces(per_rank, message) -> None:
    with pytest.raises(CheckpointError, match=message):
        plan_writes(per_rank)


@pytest.mark.parametrize(("name", "message"), [("", "invalid tensor name"), ("a//b", "invalid"), ("a/../b", "invalid")])
def test_piece_names_are_hdf5_paths(name, message) -> None:
    with pytest.raises(CheckpointError, match=message):
        _meta(name, (1,), (0,), (1,))


def test_piece_outside_its_tensor_is_rejected() -> None:
    with pytest.raises(CheckpointError, match="outside the global shape"):
        _meta("w", (4, 4), (3, 0), (2, 4))


# --- saving and loading on ranks ------------------------------------------------------------

DTYPES = ("float32", "float64", "bfloat16", "int64", "bool")


def _reference_tensors():
    import torch

    generator = torch.Generator().manual_seed(7)
    tensors = {f"model/{dtype}": (torch.randn(6, 5, generator=generator) * 10).to(getattr(torch, dtype))
               for dtype in DTYPES}
    tensors["model/scalar"] = torch.tensor(3.5)
    tensors["model/empty"] = torch.zeros(0, 3)
    tensors["optim/split"] = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    return tensors


def _save_steps(world, root, steps, keep, async_save):
    """Rank r holds rows [4r, 4r+4) of optim/split and the rest whole; saves ``steps``."""
    import torch
    import torch.distributed as dist

    from hpc.checkpoint import Checkpointer, Piece

    tensors = _reference_tensors()
    split = tensors.pop("optim/split")
    rows = split.shape[0] // world.size
    pieces = [Piece.whole(name, t) for name, t in tensors.items()]
    pieces.append(Piece("optim/split", split[world.rank * rows : (world.rank + 1) * rows], tuple(split.shape),
                        (world.rank * rows, 0)))
    saver = Checkpointer(root, dist.group.WORLD, keep=keep, async_save=async_save)
    for step in steps:
        saver.save(step, pieces, {"counter": torch.tensor([world.rank, step])}, {"note": "test", "layout_dp": 2})
    return saver.finalize()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Two ranks, asynchronous, keep=2: steps 1..4 saved, 3 and 4 kept."""
    root = tmp_path_factory.mktemp("ckpt")
    stale = root / "step-00000002.tmp-0123abcd"
    stale.mkdir(parents=True)  # a save a crash abandoned
    committed = run_ranks(2, _save_steps, str(root), [1, 2, 3, 4], 2, True, timeout=120)
    assert committed[0] == root / "step-00000004" and committed[1] is None
    return root


def test_retention_keeps_the_newest_and_latest_points_at_it(saved) -> None:
    assert [(e.step, e.complete) for e in list_checkpoints(saved)] == [(3, True), (4, True)]
    assert read_latest(saved) == "step-00000004"
    assert find_latest(saved) == saved / "step-00000004"
    assert sorted(os.listdir(saved / "step-00000004")) == ["COMPLETE", "index.h5", "rank-00000.h5", "rank-00001.h5"]


def test_round_trip_of_every_dtype_scalar_empty_and_split_tensor(saved) -> None:
    import torch

    from hpc.checkpoint import Piece, load_into, load_rank_state, open_checkpoint, read_tensor

    index = open_checkpoint(saved / "step-00000004")
    expected = _reference_tensors()
    assert index.step == 4 and index.world_size == 2 and index.attrs == {"note": "test", "layout_dp": 2}
    assert set(index.tensors) == set(expected)
    for name, tensor in expected.items():
        loaded = read_tensor(index, name)
        assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape and torch.equal(loaded, tensor), name
    assert len(index.tensors["optim/split"].pieces) == 2
    block = torch.empty(3, 4)  # straddles both ranks' pieces: rows 2..4, columns 1..4
    load_into(index, [Piece("optim/split", block, (8, 6), (2, 1))])
    assert torch.equal(block, expected["optim/split"][2:5, 1:5])
    for rank in (0, 1):
        assert torch.equal(load_rank_state(index, rank)["counter"], torch.tensor([rank, 4]))
    assert load_rank_state(index, 2) == {}


def test_replicated_pieces_are_written_once_spread_over_the_ranks(saved) -> None:
    index = read_index(saved / "step-00000004")
    whole = [r for r in index.tensors.values() if len(r.pieces) == 1 and r.nbytes]
    writers = {r.pieces[0].file for r in whole}
    assert writers == {"rank-00000.h5", "rank-00001.h5"}
    for file in writers:
        with h5py.File(saved / "step-00000004" / file) as shard:
            stored = _datasets(shard["tensors"])
        assert stored == {r.name for r in index.tensors.values() if any(p.file == file for p in r.pieces)}


def _datasets(group: h5py.Group) -> set[str]:
    names: set[str] = set()
    group.visititems(lambda name, item: names.add(name) if isinstance(item, h5py.Dataset) else None)
    return names


def test_load_rejects_a_piece_of_the_wrong_shape_or_name(saved) -> None:
    import torch

    from hpc.checkpoint import Piece, load_into, open_checkpoint

    index = open_checkpoint(saved / "step-00000004")
    with pytest.raises(CheckpointError, match=r"float32\[8, 6\] in the checkpoint"):
        load_into(index, [Piece.whole("optim/split", torch.empty(8, 7))])
    with pytest.raises(CheckpointError, match="has no tensor model/nope"):
        load_into(index, [Piece.whole("model/nope", torch.empty(1))])


def test_hdf5_tools_read_the_index_without_python(saved, tmp_path) -> None:
    step = saved / "step-00000004"
    header = subprocess.run(["h5dump", "-H", str(step / "index.h5")], capture_output=True, text=True, cwd=tmp_path)
    assert header.returncode == 0, header.stderr
    assert 'DATASET "split"' in header.stdout and 'ATTRIBUTE "piece_files"' in header.stdout
    listing = subprocess.run(["h5ls", "-r", str(step / "index.h5")], capture_output=True, text=True, cwd=tmp_path)
    assert "/tensors/optim/split     Dataset {8, 6}" in listing.stdout
    assert "External Link {rank-00001.h5//rank}" in listing.stdout
    # The virtual dataset resolves its sources next to the index, from any working directory.
    data = subprocess.run(["h5dump", "-d", "/tensors/optim/split", "-w", "0", str(step / "index.h5")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert data.returncode == 0, data.stderr
    assert "(7,0): 42, 43, 44, 45, 46, 47" in data.stdout


def test_a_save_that_cannot_write_fails_at_finalize_when_asynchronous(tmp_path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(AssertionError, match="background save of step 1 failed"):
        run_ranks(1, _save_steps, str(blocker), [1], 1, True, timeout=60)
    with pytest.raises(AssertionError, match="save of step 1 failed: rank 0"):
        run_ranks(1, _save_steps, str(blocker), [1], 1, False, timeout=60)


def _save_changing_pieces(world, root):
    """Step 1: a tensor on both ranks; steps 2 and 3: rank 1 adds one of its own, then both change values."""
    import torch
    import torch.distributed as dist

    from hpc.checkpoint import Checkpointer, Piece

    shared, own = torch.zeros(4, 3), torch.zeros(2)
    saver = Checkpointer(root, dist.group.WORLD, keep=3, async_save=True)
    for step in (1, 2, 3):
        shared.fill_(step)
        own.fill_(10 * step)
        pieces = [Piece.whole("model/shared", shared)] + ([Piece.whole("model/own", own)] if world.rank and step > 1
                                                           else [])
        saver.save(step, pieces, {"step": torch.tensor([step])})
        shared.fill_(-1)  # after the copy: must not reach the checkpoint
    return saver.finalize()


def test_pieces_that_change_on_one_rank_are_agreed_anew_and_each_save_gets_its_own_id(tmp_path) -> None:
    import torch

    from hpc.checkpoint import load_rank_state, open_checkpoint, read_tensor

    run_ranks(2, _save_changing_pieces, str(tmp_path), timeout=120)
    ids = {}
    for step in (1, 2, 3):
        index = open_checkpoint(tmp_path / f"step-{step:08d}")
        assert set(index.tensors) == ({"model/shared"} if step == 1 else {"model/shared", "model/own"})
        assert torch.equal(read_tensor(index, "model/shared"), torch.full((4, 3), float(step)))
        if step > 1:
            assert torch.equal(read_tensor(index, "model/own"), torch.full((2,), 10.0 * step))
        assert torch.equal(load_rank_state(index, 1)["step"], torch.tensor([step]))
        ids[step] = index.save_id
    assert len(set(ids.values())) == 3
    # step 2 agreed anew (rank 1's pieces changed), step 3 reused that agreement: its random part, another count
    assert ids[3][:-8] == ids[2][:-8] != ids[1][:-8]


def test_retention_never_deletes_what_was_just_written_and_a_resave_replaces(tmp_path) -> None:
    root = tmp_path / "ckpt"
    (root / "step-00000005.retired-00aa").mkdir(parents=True)  # a deletion a crash interrupted
    run_ranks(1, _save_steps, str(root), [2, 1, 1], 1, False, timeout=60)
    assert sorted(os.listdir(root)) == ["latest", "step-00000001", "step-00000002"]
    assert read_latest(root) == "step-00000001" and find_latest(root) == root / "step-00000002"
    assert read_index(root / "step-00000001").world_size == 1


# --- discovery ------------------------------------------------------------------------------


def test_resume_choices(saved, tmp_path) -> None:
    assert resolve_resume("never", saved) is None
    assert resolve_resume("auto", tmp_path / "nothing-yet") is None
    assert resolve_resume("auto", saved) == saved / "step-00000004"
    assert resolve_resume(str(saved / "step-00000003"), tmp_path) == saved / "step-00000003"
    assert resolve_resume(str(saved), tmp_path) == saved / "step-00000004"
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_resume(str(tmp_path / "missing"), saved)
    unfinished = tmp_path / "step-00000009"
    unfinished.mkdir()
    with pytest.raises(CheckpointError, match="incomplete"):
        resolve_resume(str(unfinished), saved)


def test_unfinished_saves_are_listed_but_never_found(saved, tmp_path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    (root / "step-00000009.tmp-ffff").mkdir()
    (root / "step-00000008").mkdir()  # renamed by hand without its marker
    assert find_latest(root) == root / "step-00000004"
    assert [(e.step, e.complete) for e in list_checkpoints(root)] == [(3, True), (4, True), (8, False), (9, False)]


# --- damage ---------------------------------------------------------------------------------


def _damaged_copy(saved: Path, tmp_path: Path) -> tuple[Path, str]:
    step = tmp_path / "step-00000004"
    shutil.copytree(saved / "step-00000004", step)
    index = read_index(step)
    return step, index.tensors["optim/split"].pieces[1].file


def _flip_a_data_byte(path: Path, dataset: str) -> None:
    with h5py.File(path) as shard:
        where = shard[dataset].id.get_offset() + 5
    with open(path, "r+b") as handle:
        handle.seek(where)
        byte = handle.read(1)
        handle.seek(where)
        handle.write(bytes([byte[0] ^ 0x10]))


def test_a_flipped_bit_fails_verify_and_resume_naming_file_and_dataset(saved, tmp_path, capsys) -> None:
    from hpc.checkpoint import open_checkpoint, read_tensor

    step, file = _damaged_copy(saved, tmp_path)
    _flip_a_data_byte(step / file, "tensors/optim/split")
    assert main(["ckpt", "verify", str(step)]) != 0
    err = capsys.readouterr().err
    assert f"{step / file}: tensors/optim/split: damaged: its data hashes to" in err
    assert "failed verification: 1 problem" in err
    with pytest.raises(CheckpointError) as info:
        read_tensor(open_checkpoint(step), "optim/split")
    assert str(step / file) in str(info.value) and "tensors/optim/split" in str(info.value)


def test_a_piece_needed_only_in_part_is_still_checked_whole(saved, tmp_path) -> None:
    import torch

    from hpc.checkpoint import Piece, load_into, open_checkpoint

    step, file = _damaged_copy(saved, tmp_path)
    _flip_a_data_byte(step / file, "tensors/optim/split")  # rank 1's rows 4..7; the byte is in row 4
    block = torch.empty(1, 6)  # row 7 alone: a resharded rank that never sees the flipped byte
    with pytest.raises(CheckpointError, match="damaged") as info:
        load_into(open_checkpoint(step), [Piece("optim/split", block, (8, 6), (7, 0))])
    assert str(step / file) in str(info.value) and "tensors/optim/split" in str(info.value)


def test_every_dataset_can_be_checked_from_its_byte_range_without_hdf5(saved) -> None:
    """What `tail -c +START | head -c LENGTH | xxhsum -H3` does with the manifest's byte ranges."""
    import xxhash

    step = saved / "step-00000004"
    index = read_index(step)
    checked = 0
    for shard in index.shards.values():
        raw = (step / shard.file).read_bytes()
        with h5py.File(step / shard.file) as handle:
            for name, (start, end) in shard.extents.items():
                assert xxhash.xxh3_64_hexdigest(raw[start:end]) == handle[name].attrs["xxh3_64"], name
                checked += 1
    assert checked == sum(len(shard.extents) for shard in index.shards.values()) > 10


def test_a_truncated_shard_fails_verify_and_resume_naming_file_and_dataset(saved, tmp_path, capsys) -> None:
    from hpc.checkpoint import open_checkpoint

    step, file = _damaged_copy(saved, tmp_path)
    index = read_index(step)
    start, _ = index.shards[file].extents["tensors/optim/split"]
    os.truncate(step / file, start + 4)
    assert main(["ckpt", "verify", str(step)]) != 0
    err = capsys.readouterr().err
    assert f"{step / file}: tensors/optim/split: cut off" in err
    with pytest.raises(CheckpointError, match="truncated") as info:
        open_checkpoint(step)
    assert str(step / file) in str(info.value) and "tensors/optim/split" in str(info.value)


def test_a_shard_larger_than_recorded_is_not_called_truncated(saved, tmp_path) -> None:
    """Issue 28: two swapped shard files were reported as 'truncated (5253413 of 5242820 bytes)'."""
    from hpc.checkpoint import open_checkpoint

    step, file = _damaged_copy(saved, tmp_path)
    size = read_index(step).shards[file].size
    with open(step / file, "ab") as handle:
        handle.write(b"x" * 10)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(step)
    assert str(info.value).startswith(f"{step / file} is 10 bytes larger than the index records ({size + 10} of {size} "
                               "bytes): not the file this save wrote")
    os.truncate(step / file, size - 10)
    with pytest.raises(CheckpointError, match=rf"is truncated: 10 bytes short \({size - 10} of {size} bytes\)"):
        open_checkpoint(step)


def test_a_missing_shard_is_named_rather_than_read_as_fill_values(saved, tmp_path, capsys) -> None:
    from hpc.checkpoint import open_checkpoint

    step, file = _damaged_copy(saved, tmp_path)
    (step / file).unlink()
    assert main(["ckpt", "verify", str(step)]) != 0
    assert f"{step / file}: missing" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=f"{step / file} is missing"):
        open_checkpoint(step)


# --- the command line -----------------------------------------------------------------------


def test_ckpt_ls_show_verify(saved, capsys) -> None:
    assert main(["ckpt", "ls", str(saved)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "complete" in lines[1] and lines[2].endswith("step-00000004  <- latest")
    assert main(["ckpt", "show", str(saved / "step-00000004"), "--spec"]) == 0
    out = capsys.readouterr().out
    assert "step 4 | world size 2 | 2 files" in out and "layout_dp=2" in out
    assert any(line.split()[:4] == ["optim/split", "float32", "8x6", "2"] for line in out.splitlines())
    assert "rank-00001.h5" in out and "counter" in out
    assert main(["ckpt", "verify", str(saved / "step-00000004")]) == 0
    # 7 whole tensors, 2 pieces of optim/split, one counter per rank
    assert capsys.readouterr().out.startswith("ok: 11 datasets in 2 files")


def test_ckpt_errors_are_one_line(tmp_path, capsys) -> None:
    assert main(["ckpt", "show", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hpc: error: {tmp_path} is not a checkpoint: no index.h5") and err.count("\n") == 1
    assert main(["ckpt", "ls", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"hpc: error: no such directory: {tmp_path / 'nope'}\n"


def test_ckpt_show_lists_a_damaged_checkpoint_and_names_its_missing_and_short_files(saved, tmp_path, capsys) -> None:
    step = tmp_path / "step-00000004"
    shutil.copytree(saved / "step-00000004", step)
    (step / "rank-00001.h5").unlink()
    with open(step / "rank-00000.h5", "r+b") as shard:
        shard.truncate(1000)
    assert main(["ckpt", "show", str(step)]) == 2
    captured = capsys.readouterr()
    assert "rank-00000.h5" in captured.out and "ON DISK 1000 BYTES" in captured.out and "  MISSING" in captured.out
    assert captured.err == (f"hpc: error: {step}: 2 of its files missing or not the size its index recorded "
                            "(rank-00000.h5, rank-00001.h5): hpc ckpt verify checks every file and checksum\n")
    assert main(["ckpt", "show", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"hpc: error: no such directory: {tmp_path / 'nope'}\n"
    spec = tmp_path / "job.toml"
    spec.write_text("")
    assert main(["ckpt", "ls", str(spec)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (f"hpc: error: {spec}: not a directory (give a checkpoint "
                                                   "directory or a run's directory)\n")


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_writes_the_global_tensors(saved, tmp_path, suffix) -> None:
    import torch

    dest = tmp_path / f"model{suffix}"
    assert main(["ckpt", "export", str(saved / "step-00000004"), "--to", str(dest), "--only", "model/"]) == 0
    if suffix == ".pt":
        loaded = torch.load(dest, weights_only=True)
    else:
        from safetensors.torch import load_file

        loaded = load_file(dest)
    expected = {k.removeprefix("model/"): v for k, v in _reference_tensors().items() if k.startswith("model/")}
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_export_replaces_an_existing_file_only_when_forced_whole_and_never_through_a_link(saved, tmp_path, capsys,
                                                                                          monkeypatch) -> None:
    """Without --force an existing --to is refused; with it the file is replaced whole: a write that fails leaves
    the old bytes (no partial file beside them), and a link at --to is replaced, not written through."""
    import torch

    step = str(saved / "step-00000004")
    dest = tmp_path / "keep.pt"
    dest.write_text("the user's file")
    assert main(["ckpt", "export", step, "--to", str(dest)]) == 2
    assert capsys.readouterr().err == f"hpc: error: --to {dest}: the file exists (pass --force to replace it)\n"
    assert dest.read_text() == "the user's file"

    def fail_midway(tensors, path):
        Path(path).write_bytes(b"half")
        raise OSError(27, "File too large")

    with monkeypatch.context() as patched:
        patched.setattr(torch, "save", fail_midway)
        assert main(["ckpt", "export", step, "--to", str(dest), "--force"]) == 2
    assert capsys.readouterr().err == f"hpc: error: --to {dest}: cannot write it ([Errno 27] File too large)\n"
    assert dest.read_text() == "the user's file" and sorted(p.name for p in tmp_path.iterdir()) == ["keep.pt"]

    assert main(["ckpt", "export", step, "--to", str(dest), "--force"]) == 0
    assert set(torch.load(dest, weights_only=True)) == set(_reference_tensors())

    target = tmp_path / "target.pt"
    target.write_text("behind the link")
    link = tmp_path / "link.pt"
    link.symlink_to(target)
    assert main(["ckpt", "export", step, "--to", str(link), "--force"]) == 0
    assert target.read_text() == "behind the link" and not link.is_symlink()


def test_export_refuses_an_unknown_suffix(saved, tmp_path, capsys) -> None:
    assert main(["ckpt", "export", str(saved / "step-00000004"), "--to", str(tmp_path / "x.bin")]) == 2
    assert ".safetensors or .pt" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_checkpoint_json_rows(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hpc.cli.main", "bench", "checkpoint", "-n", "2", "--launcher", "local",
         "--size", "4M", "--iters", "1", "--dir", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert {(r["impl"], r["op"]) for r in rows} == {
        (impl, op) for impl in ("hdf5", "hdf5-async", "torch.save", "dcp", "disk") for op in ("save", "load")
    } | {("memcpy", "save")}
    for row in rows:
        assert row["bytes"] >= 4 << 20 and row["time_s"] > 0
        assert row["MBps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e6)
        assert (row["stall_s"] is None) == (row["op"] == "load") == (row["stall_of_memcpy"] is None)
    memcpy = next(r["stall_s"] for r in rows if r["impl"] == "memcpy")
    for row in rows:
        if row["stall_s"] is not None:
            assert row["stall_of_memcpy"] == pytest.approx(row["stall_s"] / memcpy)
    assert os.listdir(tmp_path) == []
