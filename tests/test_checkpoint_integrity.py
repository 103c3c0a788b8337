"""A damaged checkpoint never loads as wrong data: the index and the shards cross-check each other,
file types and links are checked before anything is opened, and every failure is one CheckpointError line."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc.checkpoint.discovery import list_checkpoints, read_latest, resolve_resume
from hpc.checkpoint.format import CheckpointError, read_index
from hpc.cli.main import main
from tests.ranks import run_ranks
from tests.test_checkpoint import _reference_tensors, _save_steps

SPLIT = "tensors/optim/split"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Two ranks, synchronous: steps 3 and 4; rank r wrote rows [4r, 4r+4) of optim/split."""
    root = tmp_path_factory.mktemp("ckpt")
    run_ranks(2, _save_steps, str(root), [3, 4], 2, False, timeout=120)
    return root


def _copy(saved: Path, tmp_path: Path, step: int = 4) -> Path:
    dest = tmp_path / f"step-{step:08d}"
    shutil.copytree(saved / dest.name, dest)
    return dest


def _set_attr(path: Path, obj: str, key: str, value) -> None:
    """Rewrite one attribute; a shard's new size goes into the index, so only the attribute is wrong."""
    with h5py.File(path, "r+") as handle:
        handle[obj].attrs[key] = value
    _record_size(path)


def _record_size(path: Path) -> None:
    if path.name != "index.h5":
        with h5py.File(path.parent / "index.h5", "r+") as index:
            index[f"manifest/{path.name}"].attrs["size"] = path.stat().st_size


def _one_line_naming(exc: BaseException, *names: str) -> None:
    text = str(exc)
    assert isinstance(exc, CheckpointError) and "\n" not in text, text
    for name in names:
        assert name in text, (name, text)


def _load_all(step: Path) -> None:
    from hpc.checkpoint import load_rank_state, open_checkpoint, read_tensor

    index = open_checkpoint(step)
    for name in index.tensors:
        read_tensor(index, name)
    for rank in range(index.world_size):
        load_rank_state(index, rank)


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """The command in its own process: a hang fails the test instead of stalling the suite."""
    return subprocess.run([sys.executable, "-m", "hpc.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


# --- 1. the index and the shards cross-check each other -----------------------------------------


@pytest.mark.parametrize("files", [[b"rank-00001.h5", b"rank-00001.h5"], [b"rank-00001.h5", b"rank-00000.h5"]])
def test_an_index_mapping_a_piece_to_the_wrong_shard_is_refused(saved, tmp_path, capsys, files) -> None:
    """The outside tester's flipped heap bit: rank 1's half must never load into rank 0's half."""
    import torch

    from hpc.checkpoint import Piece, load_into, open_checkpoint

    step = _copy(saved, tmp_path)
    _set_attr(step / "index.h5", SPLIT, "piece_files", np.array(files))
    assert main(["ckpt", "verify", str(step)]) != 0
    err = capsys.readouterr().err
    assert SPLIT in err and "failed verification" in err
    with pytest.raises(CheckpointError) as info:
        load_into(open_checkpoint(step), [Piece("optim/split", torch.empty(4, 6), (8, 6), (0, 0))])
    _one_line_naming(info.value, SPLIT)
    assert str(step) in str(info.value)


def test_a_swapped_mapping_is_caught_by_the_shards_own_offsets(saved, tmp_path, capsys) -> None:
    from hpc.checkpoint import open_checkpoint, read_tensor

    step = _copy(saved, tmp_path)
    _set_attr(step / "index.h5", SPLIT, "piece_files", np.array([b"rank-00001.h5", b"rank-00000.h5"]))
    assert main(["ckpt", "verify", str(step)]) != 0
    err = capsys.readouterr().err
    assert f"{step / 'rank-00001.h5'}: {SPLIT}: disagrees with the index: its offsets is [4, 0]" in err
    with pytest.raises(CheckpointError, match="disagrees with the index") as info:
        read_tensor(open_checkpoint(step), "optim/split")
    _one_line_naming(info.value, str(step / "rank-00001.h5"), SPLIT)


@pytest.mark.parametrize(("key", "value"), [("offsets", np.array([0, 0])), ("tensor", np.bytes_(b"optim/other")),
                                            ("shape", np.array([3, 6])), ("global_shape", np.array([8, 7]))])
def test_a_shard_whose_own_record_disagrees_is_refused(saved, tmp_path, capsys, key, value) -> None:
    step = _copy(saved, tmp_path)
    _set_attr(step / "rank-00001.h5", SPLIT, key, value)
    assert main(["ckpt", "verify", str(step)]) != 0
    assert f"{step / 'rank-00001.h5'}: {SPLIT}: disagrees with the index: its {key} is" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=f"its {key} is") as info:
        _load_all(step)
    _one_line_naming(info.value, str(step / "rank-00001.h5"), SPLIT)


# --- 2. a shard from another step or another save ------------------------------------------------


def test_a_shard_copied_in_from_an_older_step_is_refused(saved, tmp_path, capsys) -> None:
    step = _copy(saved, tmp_path)
    older = saved / "step-00000003" / "rank-00001.h5"
    assert older.stat().st_size == (step / "rank-00001.h5").stat().st_size  # the size check alone would pass it
    shutil.copyfile(older, step / "rank-00001.h5")
    assert main(["ckpt", "verify", str(step)]) != 0
    err = capsys.readouterr().err
    assert f"{step / 'rank-00001.h5'}: not part of this checkpoint: its step is 3, the index says 4" in err
    with pytest.raises(CheckpointError, match="not part of this checkpoint") as info:
        _load_all(step)
    _one_line_naming(info.value, str(step / "rank-00001.h5"))


def test_a_shard_of_another_save_at_the_same_step_is_refused(saved, tmp_path) -> None:
    step = _copy(saved, tmp_path)
    _set_attr(step / "rank-00000.h5", "/", "save_id", np.bytes_(b"0123456789abcdef0123456789abcdef"))
    with pytest.raises(CheckpointError, match="its save_id is") as info:
        _load_all(step)
    _one_line_naming(info.value, str(step / "rank-00000.h5"))


def test_a_format_2_checkpoint_is_refused_in_one_line(saved, tmp_path) -> None:
    step = _copy(saved, tmp_path)
    _set_attr(step / "index.h5", "/", "format_version", 2)
    with pytest.raises(CheckpointError, match="is format version 2; this version of hpc-batch reads version 3") as info:
        read_index(step)
    _one_line_naming(info.value, str(step / "index.h5"))


# --- 3. dtypes come from an allow-list ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [b"float33", b"uint9", b"load"])
def test_an_unknown_dtype_is_one_line_naming_file_and_dataset(saved, tmp_path, capsys, dtype) -> None:
    step = _copy(saved, tmp_path)
    _set_attr(step / "index.h5", "tensors/model/float32", "dtype", np.bytes_(dtype))
    assert main(["ckpt", "show", str(step)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tensors/model/float32" in err and f"dtype '{dtype.decode()}'" in err
    step = _copy(saved, tmp_path / "rank-state")
    _set_attr(step / "rank-00000.h5", "rank/counter", "dtype", np.bytes_(dtype))
    with pytest.raises(CheckpointError, match="not one of float64") as info:
        _load_all(step)
    _one_line_naming(info.value, str(step / "rank-00000.h5"), "rank/counter")
    assert main(["ckpt", "verify", str(step)]) != 0
    assert f"{step / 'rank-00000.h5'}: rank/counter: " in capsys.readouterr().err


# --- 4. FIFOs and links are never opened or followed -------------------------------------------------


def test_a_fifo_in_place_of_a_shard_or_the_index_fails_at_once(saved, tmp_path) -> None:
    step = _copy(saved, tmp_path)
    (step / "rank-00001.h5").unlink()
    os.mkfifo(step / "rank-00001.h5")
    for args in (("verify", str(step)), ("export", str(step), "--to", str(tmp_path / "x.pt"))):
        done = _cli("ckpt", *args)
        assert done.returncode != 0 and "rank-00001.h5" in done.stderr and "Traceback" not in done.stderr, done
    with pytest.raises(CheckpointError, match="not a regular file"):
        _load_all(step)
    (step / "index.h5").unlink()
    os.mkfifo(step / "index.h5")
    for args in (("show", str(step)), ("verify", str(step))):
        done = _cli("ckpt", *args)
        assert done.returncode != 0 and "index.h5 is not a regular file" in done.stderr, done
        assert "Traceback" not in done.stderr


def _fifo_link(tmp_path: Path) -> h5py.ExternalLink:
    os.mkfifo(tmp_path / "fifo.h5")
    return h5py.ExternalLink(str(tmp_path / "fifo.h5"), "/x")


@pytest.mark.parametrize("where", ["index.h5:tensors/model/float32", "index.h5:manifest/rank-00000.h5",
                                   "index.h5:tensors", f"rank-00001.h5:{SPLIT}", "rank-00000.h5:rank/counter"])
def test_external_and_soft_links_are_never_followed(saved, tmp_path, where) -> None:
    file, obj = where.split(":")
    for kind, link in (("ExternalLink", _fifo_link(tmp_path)), ("SoftLink", h5py.SoftLink("/x"))):
        step = _copy(saved, tmp_path / kind)
        with h5py.File(step / file, "r+") as handle:
            handle.move(obj, f"{obj}-moved")  # its bytes stay where the manifest says
            handle[obj] = link
        _record_size(step / file)
        commands = [("verify", str(step))]
        if not obj.startswith("rank/"):  # export reads no rank state: it rightly succeeds past that link
            commands.append(("export", str(step), "--to", str(tmp_path / "x.pt")))
        for args in commands + [("show", str(step))] * (file == "index.h5") if kind == "ExternalLink" else ():
            done = _cli("ckpt", *args)
            assert done.returncode != 0 and "Traceback" not in done.stderr, (args, done)
            assert "never followed" in done.stderr, (args, done.stderr)
        with pytest.raises(CheckpointError, match=f"{kind}, which is never followed") as info:
            _load_all(step)
        _one_line_naming(info.value, str(step / file))


# --- 5. the stored job spec --------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [np.bytes_(b"[" * 200_000 + b"]" * 200_000), np.bytes_(b'{"job": '), 17])
def test_show_spec_of_a_damaged_job_spec_is_one_line(saved, tmp_path, capsys, spec) -> None:
    step = _copy(saved, tmp_path)
    _set_attr(step / "index.h5", "/", "job_spec", spec)
    assert main(["ckpt", "show", str(step), "--spec"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "job_spec" in err and str(step / "index.h5") in err, err


# --- 6. a bad `latest` ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["garbage", "loop", "directory", "fifo", "outside"])
def test_ls_survives_a_bad_latest(saved, tmp_path, kind) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    latest = root / "latest"
    latest.unlink()
    if kind == "garbage":
        latest.write_bytes(b"\xff\xfe\x00step" * 1000)
    elif kind == "loop":
        latest.symlink_to("latest")
    elif kind == "directory":
        latest.mkdir()
    elif kind == "fifo":
        os.mkfifo(latest)
    else:
        latest.write_text("../../etc\n")
    assert read_latest(root) is None
    done = _cli("ckpt", "ls", str(root))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done
    assert "step-00000004" in done.stdout and "<- latest" not in done.stdout


# --- 7. a checkpoint directory that cannot be listed ----------------------------------------------------


def test_a_checkpoint_directory_that_is_a_symlink_loop_is_an_error_not_a_fresh_start(tmp_path, capsys) -> None:
    loop = tmp_path / "checkpoints"
    loop.symlink_to("checkpoints")
    with pytest.raises(CheckpointError, match="cannot list the checkpoint directory") as info:
        resolve_resume("auto", loop)
    _one_line_naming(info.value, str(loop))
    assert main(["ckpt", "ls", str(loop)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert list_checkpoints(tmp_path / "not-yet") == []  # a directory that does not exist yet: a fresh start
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(CheckpointError, match="cannot list"):
        resolve_resume("auto", a_file)


def test_an_intact_checkpoint_still_loads_equal(saved) -> None:
    import torch

    from hpc.checkpoint import load_rank_state, open_checkpoint, read_tensor

    index = open_checkpoint(saved / "step-00000004")
    for name, tensor in _reference_tensors().items():
        assert torch.equal(read_tensor(index, name), tensor), name
    assert torch.equal(load_rank_state(index, 1)["counter"], torch.tensor([1, 4]))


# --- fuzzing: flipped bits and truncated files ------------------------------------------------------

FILES = ("index.h5", "rank-00000.h5", "rank-00001.h5")
LOAD_TIMEOUT_S = 30


def _everything(step: str) -> dict:
    """What a resume and an export read: every whole tensor, a resharded block, every rank's state."""
    import torch

    from hpc.checkpoint import Piece, load_into, load_rank_state, open_checkpoint, read_tensor

    index = open_checkpoint(step)
    loaded = {name: read_tensor(index, name) for name in sorted(index.tensors)}
    block = torch.empty(3, 4)  # straddles both ranks' pieces
    load_into(index, [Piece("optim/split", block, (8, 6), (2, 1))])
    loaded["block"] = block
    for rank in (0, 1):
        loaded |= {f"rank{rank}/{key}": value for key, value in load_rank_state(index, rank).items()}
    return loaded


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


_ORIGINAL: dict = {}


def _outcome(step: str, original: str) -> tuple[str, str]:
    """In the worker: ("equal", ...) or ("error", the line); any other kind is a failure of the test."""
    from hpc.checkpoint.verify import verify_checkpoint

    try:
        report = verify_checkpoint(step)
    except Exception:
        return "verify raised", traceback.format_exc()
    if any("\n" in str(problem) or step not in str(problem) for problem in report.problems):
        return "verify problem not one line naming its file", "; ".join(map(str, report.problems))
    if not _ORIGINAL:
        _ORIGINAL.update(_everything(original))
    try:
        loaded = _everything(step)
    except CheckpointError as exc:
        if report.ok:
            return "verify passed what the load refused", str(exc)
        return "error", str(exc)
    except Exception:
        return "crash", traceback.format_exc()
    if not _same(loaded, _ORIGINAL):
        return "different data", f"verify ok: {report.ok}"
    return "equal", ""


@pytest.fixture(scope="module")
def worker():
    """One process that loads: a hang is a timeout there, not a stalled suite."""
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("forkserver"))
    yield pool
    pool.shutdown(wait=False, cancel_futures=True)


def _damage(step: Path, edits) -> None:
    for file, kind, where, bit in edits:
        path = step / file
        size = path.stat().st_size
        if kind == "truncate" or not size:
            os.truncate(path, int(where * size))
            continue
        at = min(size - 1, int(where * size))
        with open(path, "r+b") as handle:
            handle.seek(at)
            byte = handle.read(1)[0]
            handle.seek(at)
            handle.write(bytes([byte ^ (1 << bit)]))


EDITS = st.lists(st.tuples(st.sampled_from(FILES), st.sampled_from(("flip",) * 6 + ("truncate",)),
                           st.floats(0, 1, exclude_max=True), st.integers(0, 7)), min_size=1, max_size=3)


@settings(max_examples=200, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(edits=EDITS)
def test_damaged_checkpoints_load_equal_or_fail_in_one_line(saved, worker, edits) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        step = Path(scratch) / "step-00000004"
        shutil.copytree(saved / step.name, step)
        _damage(step, edits)
        future = worker.submit(_outcome, str(step), str(saved / step.name))
        try:
            kind, detail = future.result(timeout=LOAD_TIMEOUT_S)
        except FutureTimeout:
            for process in list(worker._processes.values()):
                process.kill()
            pytest.fail(f"loading hung after {edits}")
        assert kind in ("equal", "error"), f"{kind} after {edits}: {detail}"
        if kind == "error":
            assert "\n" not in detail and str(step) in detail, detail


def test_a_latest_that_is_a_directory_does_not_fail_a_save(tmp_path, capsys) -> None:
    """``latest`` is only a hint: a directory in its place is reported and left, the save stands."""
    from hpc.checkpoint.discovery import write_latest
    from hpc.checkpoint.format import LATEST

    step_dir = tmp_path / "step-00000002"
    step_dir.mkdir()
    (tmp_path / LATEST).mkdir()
    write_latest(tmp_path, step_dir)
    assert (tmp_path / LATEST).is_dir() and not list(tmp_path.glob(f".{LATEST}.tmp-*"))
    assert f"checkpoint {step_dir} is saved, but {tmp_path / LATEST} could not point at it" in capsys.readouterr().err
