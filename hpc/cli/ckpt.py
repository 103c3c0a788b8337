"""``hpc ckpt ls|show|verify|export``.

Nothing heavy at module level (``hpc --help`` imports this): h5py is imported by the
commands that read checkpoints, torch only by ``export``, and transformers (through
``jobs.models.hf``) only by ``export --format hf``, which rebuilds the model's config from the
job spec stored in the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from hpc.text import human_bytes

EXPORT_FORMATS = ("safetensors", "pt", "hf")


def add_parser(commands: argparse._SubParsersAction) -> None:
    ckpt = commands.add_parser("ckpt", help="list, inspect, verify and export checkpoints")
    actions = ckpt.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = actions.add_parser("ls", help="the checkpoints in a directory, oldest first; of a run: both tiers")
    ls.add_argument("dir", help="checkpoint directory (checkpoint.dir, default <run_dir>/<name>/checkpoints), or a "
                                "run's directory: its checkpoints and this node's local tier "
                                "(checkpoint.local_every_steps)")
    ls.add_argument("--local-dir", default="", metavar="DIR",
                    help="the run's checkpoint.local_dir (default: $SLURM_TMPDIR, else the temporary directory)")
    ls.set_defaults(handler=cmd_ls)
    show = actions.add_parser("show", help="tensors, shapes, dtypes, layout and sizes of one checkpoint")
    show.add_argument("step_dir", help="a step-XXXXXXXX directory")
    show.add_argument("--spec", action="store_true", help="also print the job spec stored in it")
    show.set_defaults(handler=cmd_show)
    verify = actions.add_parser("verify", help="check completeness and every checksum; non-zero exit on damage")
    verify.add_argument("step_dir", help="a step-XXXXXXXX directory")
    verify.set_defaults(handler=cmd_verify)
    export = actions.add_parser("export", help="write the global tensors to one .safetensors or .pt file, or a "
                                               "transformers model directory (--format hf)")
    export.add_argument("step_dir", help="a step-XXXXXXXX directory")
    export.add_argument("--to", required=True, metavar="PATH",
                        help="destination: a file ending in .safetensors or .pt, or a directory for --format hf")
    export.add_argument("--format", choices=EXPORT_FORMATS, default=None,
                        help="safetensors or pt (default: from the --to suffix), or hf: config.json and "
                             "model.safetensors that transformers' from_pretrained loads (model.entry "
                             "jobs.models.hf:causal_lm)")
    export.add_argument("--only", default="", metavar="PREFIX",
                        help="keep tensors whose name starts with PREFIX, and strip it (e.g. --only model/)")
    export.add_argument("--max-shard-size", default=None, metavar="SIZE",
                        help="--format hf: a model larger than SIZE (default 5G) is written as shards of at most "
                             "SIZE, model-00001-of-0000N.safetensors, with model.safetensors.index.json")
    export.add_argument("--force", action="store_true",
                        help="replace an existing --to file (a model directory's weight files are always replaced)")
    export.set_defaults(handler=cmd_export)


def cmd_ls(args: argparse.Namespace) -> int:
    from hpc.checkpoint.discovery import list_checkpoints, local_root, read_latest
    from hpc.errors import ConfigError
    from hpc.rundir import CHECKPOINTS_DIR, METRICS_FILE

    if not os.path.lexists(args.dir):
        raise ConfigError(f"no such directory: {args.dir}")
    run = Path(args.dir)
    if not run.is_dir():
        raise ConfigError(f"{args.dir}: not a directory (give a checkpoint directory or a run's directory)")
    is_run = (run / CHECKPOINTS_DIR).is_dir() or (run / METRICS_FILE).is_file()
    tiers = [("shared", run)]
    if is_run:
        tiers = [("shared", run / CHECKPOINTS_DIR), ("local", local_root(run, args.local_dir))]
    print(f"{'STEP':>10}  {'TIER':<7}{'STATUS':<10} {'SIZE':>10}  PATH")
    for tier, directory in tiers:
        entries = list_checkpoints(directory)
        latest = read_latest(directory)
        for entry in entries:
            size = sum(f.stat().st_size for f in entry.path.iterdir() if f.is_file())
            status = "complete" if entry.complete else "unfinished"
            mark = "  <- latest" if entry.path.name == latest else ""
            print(f"{entry.step:>10}  {tier:<7}{status:<10} {human_bytes(size):>10}  {entry.path}{mark}")
        if not entries:
            print(f"(no {tier} checkpoints in {directory})")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from hpc.checkpoint.format import CheckpointError, read_index

    index = read_index(args.step_dir)
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(index.created_unix))
    print(f"checkpoint {index.path}")
    print(f"step {index.step} | world size {index.world_size} | {len(index.shards)} files, "
          f"{human_bytes(index.nbytes)} | saved {created}")
    attrs = " ".join(f"{key}={value}" for key, value in sorted(index.attrs.items()) if key != "job_spec")
    print(f"attrs {attrs or '-'}{' (and job_spec: --spec)' if 'job_spec' in index.attrs else ''}")
    width = max((len(name) for name in index.tensors), default=6)
    print(f"\n{'TENSOR':<{width}}  {'DTYPE':<8} {'SHAPE':<14} {'PIECES':>6} {'BYTES':>10}")
    for name, record in sorted(index.tensors.items()):
        shape = "x".join(map(str, record.shape)) or "scalar"
        size = human_bytes(record.nbytes)
        print(f"{name:<{width}}  {record.dtype:<8} {shape:<14} {len(record.pieces):>6} {size:>10}")
    print(f"\n{'FILE':<16} {'SIZE':>10}  RANK STATE")
    damaged = []
    for file, shard in sorted(index.shards.items()):
        rank = int(file.removeprefix("rank-").removesuffix(".h5"))
        own = [p.removeprefix("rank/") for p in index.rank_state_datasets(rank)]
        on_disk = _size_on_disk(index.path / file)
        problem = "" if on_disk == shard.size else "  MISSING" if on_disk is None else f"  ON DISK {on_disk} BYTES"
        damaged += [file] if problem else []
        print(f"{file:<16} {human_bytes(shard.size):>10}  {', '.join(own) or '-'}{problem}")
    if args.spec and "job_spec" in index.attrs:
        print("\njob spec:")
        print(_spec_json(index.attrs["job_spec"], index.path))
    if damaged:
        raise CheckpointError(f"{index.path}: {len(damaged)} of its files missing or not the size its index recorded "
                              f"({', '.join(damaged[:3])}{', ...' if len(damaged) > 3 else ''}): hpc ckpt verify "
                              "checks every file and checksum")
    return 0


def _size_on_disk(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


MAX_SPEC_CHARS = 1 << 20  # a job spec is a few kB; anything near this is damage


def _spec_json(text: object, step_dir: Path) -> str:
    """The stored job spec, indented."""
    return json.dumps(_spec_data(text, step_dir), indent=2)


def _spec_data(text: object, step_dir: Path) -> object:
    """The stored job spec, parsed; bounded and one error line, since a damaged attribute can hold anything."""
    from hpc.checkpoint.format import INDEX, CheckpointError, first_line

    where = {"file": str(step_dir / INDEX), "dataset": "job_spec"}
    if not isinstance(text, str) or len(text) > MAX_SPEC_CHARS:
        raise CheckpointError(f"the job_spec attribute of {step_dir / INDEX} is not a JSON text of at most "
                              f"{MAX_SPEC_CHARS} characters", **where)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's recursion limit
        raise CheckpointError(f"the job_spec attribute of {step_dir / INDEX} is not readable JSON: "
                              f"{first_line(exc)}", **where) from exc


def cmd_verify(args: argparse.Namespace) -> int:
    from hpc.checkpoint.format import CheckpointError
    from hpc.checkpoint.verify import verify_checkpoint

    report = verify_checkpoint(args.step_dir)
    for problem in report.problems:
        print(f"hpc ckpt verify: {problem}", file=sys.stderr)
    if not report.ok:
        raise CheckpointError(f"{args.step_dir} failed verification: {len(report.problems)} problem(s), listed above")
    print(f"ok: {report.datasets} datasets in {report.files} files, {human_bytes(report.nbytes)} checked")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from hpc.errors import ConfigError

    suffix = Path(args.to).suffix.lstrip(".")
    if args.format == "hf":
        if args.only:
            raise ConfigError("--only applies to --format safetensors and pt; --format hf writes the model's tensors")
        count = _export_hf(args.step_dir, args.to, _shard_bytes(args.max_shard_size))
        files = len(list(Path(args.to).glob("model*.safetensors")))
        print(f"wrote {count} tensors and config.json to {args.to}" + (f" ({files} shards and their index)"
                                                                        if files > 1 else ""))
        return 0
    if args.max_shard_size is not None:
        raise ConfigError("--max-shard-size applies to --format hf (a model directory)")
    if args.format and suffix != args.format:
        raise ConfigError(f"--to {args.to}: --format {args.format} writes a file ending in .{args.format}")
    if not args.format and suffix not in EXPORT_FORMATS[:2]:
        raise ConfigError(f"--to {args.to}: the file name must end in .safetensors or .pt "
                          "(or give --format hf for a transformers model directory)")
    from hpc.checkpoint.export import export_tensors

    count = export_tensors(args.step_dir, args.to, args.only, args.force)
    print(f"wrote {count} tensors to {args.to}")
    return 0


def _shard_bytes(text: str | None) -> int | None:
    from hpc.errors import ConfigError
    from hpc.text import parse_size

    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ConfigError(f"--max-shard-size: {exc}") from None


def _export_hf(step_dir: str, dest: str, max_shard_bytes: int | None) -> int:
    """The stored job spec names the model; jobs.models.hf rebuilds its config and writes the directory."""
    from hpc.checkpoint.format import CheckpointError, read_index
    from hpc.config import spec_from_dict
    from jobs.models.hf import export_hf

    index = read_index(step_dir)
    if "job_spec" not in index.attrs:
        raise CheckpointError(f"{index.path} holds no job spec: --format hf needs a checkpoint of a job spec "
                              "with model.entry = 'jobs.models.hf:causal_lm'")
    data = _spec_data(index.attrs["job_spec"], index.path)
    if not isinstance(data, dict):
        raise CheckpointError(f"the job_spec attribute of {index.path} is not a JSON table")
    spec = spec_from_dict(data, f"{index.path} job_spec")
    return export_hf(index.path, dest, spec, max_shard_bytes)
