"""Finding checkpoints in a directory, the ``latest`` pointer, and retention.

The truth is the directory listing: a checkpoint is a ``step-XXXXXXXX`` directory
holding a ``COMPLETE`` marker. Saves write into ``step-XXXXXXXX.tmp-<token>`` and
rename only once complete, so a crash at any moment leaves the previous checkpoint
as the newest complete one; ``latest`` is a convenience for people and tools,
updated last, and never trusted over the listing.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from hpc.checkpoint.format import (
    COMPLETE,
    LATEST,
    RETIRED_DIR,
    STEP_DIR,
    TMP_DIR,
    CheckpointError,
    first_line,
    step_dir_name,
)
from hpc.rundir import fsync_path, node_scratch


@dataclass(frozen=True)
class Entry:
    step: int
    path: Path
    complete: bool  # False: a save in progress or one that never finished (a .tmp directory)


def list_checkpoints(root: str | Path) -> list[Entry]:
    """Every step directory and unfinished save under ``root``, oldest first."""
    root = Path(root)
    if not os.path.lexists(root):
        return []
    try:
        children = list(root.iterdir())
    except OSError as exc:  # a symlink loop, a file, no permission: never "no checkpoints, start from step 0"
        raise CheckpointError(f"cannot list the checkpoint directory {root}: {exc.strerror or first_line(exc)}",
                              dir=str(root)) from exc
    entries = []
    for child in children:
        done, unfinished = STEP_DIR.fullmatch(child.name), TMP_DIR.fullmatch(child.name)
        if done and child.is_dir():
            entries.append(Entry(int(done[1]), child, (child / COMPLETE).is_file()))
        elif unfinished and child.is_dir():
            entries.append(Entry(int(unfinished[1]), child, False))
    return sorted(entries, key=lambda e: (e.step, e.complete, e.path.name))


LOCAL_DIR = "hpc-local"


def local_root(run_path: Path, base: str = "") -> Path:
    """This node's directory of the local checkpoint tier of the run in ``run_path`` (hpc/checkpoint/local.py): under
    ``base`` (``checkpoint.local_dir``), by default the node's scratch, ``$SLURM_TMPDIR`` else the temporary
    directory, named by the run's directory and a hash of its absolute path (two runs of one name do not meet)."""
    import hashlib

    scratch = node_scratch(base)
    run_id = hashlib.sha1(str(Path(run_path).resolve()).encode()).hexdigest()[:12]
    return scratch / LOCAL_DIR / f"{Path(run_path).name}-{run_id}"


def find_latest(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    complete = [e for e in list_checkpoints(root) if e.complete]
    return complete[-1].path if complete else None


def resolve_resume(resume: str, root: str | Path, key: str = "checkpoint.resume") -> Path | None:
    """``checkpoint.resume``: 'never', 'auto' (newest complete under ``root``, if any), or a path.

    A path may name a step directory or a directory of checkpoints (its newest one is
    taken); either way it must exist and be complete, since the user asked for it. Errors
    name the setting ``key`` (``checkpoint.init_from`` takes a path the same way).
    """
    if resume == "never":
        return None
    if resume == "auto":
        return find_latest(root)
    path = Path(resume)
    if STEP_DIR.fullmatch(path.name) and path.is_dir():
        if not (path / COMPLETE).is_file():
            raise CheckpointError(f"{key}={resume}: that checkpoint is incomplete (no {COMPLETE} marker)")
        return path
    latest = find_latest(path)
    if latest is None:
        raise CheckpointError(f"{key}={resume}: no complete checkpoint there")
    return latest


EARLIER_DIR = "earlier-{stamp}"  # an earlier run's checkpoints, set aside by checkpoint.resume = "never"


def set_aside(root: str | Path) -> Path | None:
    """``checkpoint.resume = "never"``: move the checkpoints already under ``root`` (complete, unfinished, and
    ``latest``) into ``root/earlier-<UTC time>``, so that the new run neither overwrites them step by step nor
    mixes with them (a later ``auto`` would otherwise resume the earlier run's highest step). Returns where they
    went, or None when there were none."""
    import time

    root = Path(root)
    entries = list_checkpoints(root)
    if not entries:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside = root / EARLIER_DIR.format(stamp=stamp)
    while aside.exists():
        aside = root / EARLIER_DIR.format(stamp=f"{stamp}-{uuid.uuid4().hex[:6]}")
    try:
        aside.mkdir()
        for entry in entries:
            os.replace(entry.path, aside / entry.path.name)
        if os.path.lexists(root / LATEST):
            os.replace(root / LATEST, aside / LATEST)
    except OSError as exc:
        raise CheckpointError(f"checkpoint.resume=never: cannot move the earlier checkpoints of {root} into {aside} "
                              f"({exc.strerror or first_line(exc)}); move or remove them, or resume them with "
                              "checkpoint.resume=auto", dir=str(root)) from exc
    fsync_path(root)
    return aside


def read_latest(root: str | Path) -> str | None:
    """The step directory ``latest`` names, if it is a regular file naming one: a hint, so anything else is None."""
    try:
        fd = os.open(Path(root) / LATEST, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        text = os.read(fd, 64).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return text if STEP_DIR.fullmatch(text) else None


def write_latest(root: Path, step_dir: Path) -> None:
    """Point ``latest`` at ``step_dir`` atomically: write a temporary file, then rename it over.

    ``latest`` is a hint for people and tools (resume scans the step directories), so a
    ``latest`` that cannot be replaced, such as a directory someone made there, is
    reported and left alone rather than failing a save that is already published.
    """
    temporary = root / f".{LATEST}.tmp-{os.getpid()}"
    temporary.write_text(step_dir.name + "\n")
    try:
        os.replace(temporary, root / LATEST)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        print(f"hpc: warning: checkpoint {step_dir} is saved, but {root / LATEST} could not point at it "
              f"({exc.strerror}); resume finds it by scanning {root}", file=sys.stderr, flush=True)
        return
    fsync_path(root)


def publish(tmp_dir: Path, step: int) -> tuple[Path, list[Path]]:
    """Rename a finished save into place; returns it and what it replaced, retired, for deletion."""
    final = tmp_dir.parent / step_dir_name(step)
    replaced = [_retire(final)] if final.exists() else []
    os.rename(tmp_dir, final)
    fsync_path(final.parent)
    return final, replaced


def retire_old(root: Path, keep: int, current: Path) -> list[Path]:
    """Beyond the ``keep`` newest complete checkpoints (``current`` always stays), retire the rest.

    Retiring is a rename out of the ``step-XXXXXXXX`` namespace, so deleting can happen
    later, in the background, and a crash half-way through never leaves a checkpoint
    that looks complete but lacks files. Call only after ``current`` is published: by
    then no save of this job is in flight, so every ``.tmp`` directory left was
    abandoned by a crash. Returns every directory to delete.
    """
    entries = list_checkpoints(root)
    complete = [e.path for e in entries if e.complete]
    doomed = [_retire(path) for path in complete[:-keep] if path != current]
    abandoned = [e.path for e in entries if TMP_DIR.fullmatch(e.path.name)]
    leftovers = [child for child in root.iterdir() if RETIRED_DIR.fullmatch(child.name)]
    if doomed:
        fsync_path(root)
    return doomed + abandoned + [p for p in leftovers if p not in doomed]


def _retire(path: Path) -> Path:
    retired = path.with_name(f"{path.name}.retired-{uuid.uuid4().hex}")
    os.rename(path, retired)
    return retired


def delete(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
