"""``hpc``: run a job spec on local ranks or under mpirun, or submit it to Slurm (``hpc submit``, ``hpc sweep``).

Nothing heavy is imported at module level: ``hpc --help`` must answer instantly on
a login node. Every check that can fail (the spec, the layout, the host list) runs
before a single process is started.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from hpc.config import show_text
from hpc.errors import ConfigError, HpcError, LayoutError, RankFailedError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpc",
        description="One job spec, three launchers: local ranks, mpirun on bare metal, Slurm.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run a job spec on local ranks or under mpirun")
    run.add_argument("spec", help="job spec (TOML), or a Python script (e.g. a Horovod one) followed by its arguments")
    run.add_argument("-n", "--nprocs", type=int, default=1, help="number of ranks (default 1)")
    run.add_argument(
        "--launcher",
        choices=("local", "mpirun"),
        help="how to start ranks (default: mpirun when Open MPI is installed, else local)",
    )
    run.add_argument("--hosts", help="mpirun hosts as HOST:SLOTS,... (bare metal)")
    run.add_argument("--bind-to", choices=("none", "core", "socket", "numa"), help="mpirun process binding")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a spec value, e.g. --set train.lr=3e-4 (repeatable; hpc spec lists every key)")
    run.add_argument("--dry-run", action="store_true", help="print the command lines and start nothing")
    run.set_defaults(handler=cmd_run)

    spec = commands.add_parser("spec", help="every setting of a job spec: key, type, default and meaning")
    spec.add_argument("--markdown", action="store_true", help="as docs/JOB_SPEC.md")
    spec.set_defaults(handler=cmd_spec)

    from hpc.cli import bench, ckpt, data, plan, report, slurm

    bench.add_parser(commands)
    ckpt.add_parser(commands)
    data.add_parser(commands)
    slurm.add_parser(commands)
    report.add_parser(commands)
    plan.add_parser(commands)
    return parser


def cmd_spec(args: argparse.Namespace) -> int:
    from hpc.config import spec_reference

    print(spec_reference(args.markdown), end="")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from hpc.cli.script import check_script
    from hpc.config import load_spec
    from hpc.runtime import launch
    from jobs.train.layout import check_layout, check_this_machine

    if args.nprocs < 1:
        raise LayoutError(f"-n must be at least 1, got {args.nprocs}")
    if args.spec.endswith(".py"):
        return run_script(args)
    if args.script_args:
        check_script(args.spec)  # options after -- and no script: that line
    spec = load_spec(args.spec, args.overrides)
    hosts = launch.parse_hosts(args.hosts) if args.hosts else []
    if hosts and sum(slots for _, slots in hosts) < args.nprocs:
        raise LayoutError(f"--hosts {args.hosts} offers {sum(s for _, s in hosts)} slots, fewer than -n {args.nprocs}")
    check_layout(spec, args.nprocs)
    if not hosts:  # the ranks compute on this machine
        check_this_machine(spec)
    launcher = args.launcher or launch.default_launcher()
    if hosts and launcher != "mpirun":
        raise LayoutError("--hosts needs --launcher mpirun (the local launcher starts ranks on this machine only)")
    if spec.parallel.transport == "mpi" and launcher != "mpirun":
        raise ConfigError("parallel.transport='mpi' needs --launcher mpirun (local ranks share no MPI world)")
    progress = "tty" if sys.stdout.isatty() else "plain"
    argv = launch.rank_argv(os.path.abspath(args.spec), args.overrides)
    launch.launch_ranks(args.nprocs, argv, launcher, hosts, args.bind_to, progress, args.dry_run, spec.run_path)
    return 0


def run_script(args: argparse.Namespace) -> int:
    """``hpc run -n 4 train.py --epochs 2``: every rank runs the script, as ``horovodrun`` or torchrun would."""
    from hpc.cli.script import check_script
    from hpc.runtime import launch

    script = check_script(args.spec)
    if args.overrides:
        raise ConfigError("--set overrides job spec values; pass a script's options after the script")
    launcher = args.launcher or launch.default_launcher()
    hosts = launch.parse_hosts(args.hosts) if args.hosts else []
    argv = (sys.executable, "-u", str(script), *args.script_args)
    launch.launch_ranks(args.nprocs, argv, launcher, hosts, args.bind_to, "plain", args.dry_run)
    return 0


SCRIPT_COMMANDS = ("run", "submit", "sweep")  # they pass what follows -- to a script
RANK_COMMANDS = ("run", "sweep", "bench", "plan")  # they may start ranks (when they loaded the launcher)


def split_script_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(hpc's arguments, the script's): ``hpc submit train.py --nodes 2 -- --epochs 3`` splits at the first ``--``."""
    argv = list(argv)
    if argv and argv[0] in SCRIPT_COMMANDS and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv, script_args = split_script_args(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(argv)
    stray = unknown and not (args.command == "run" and args.spec.endswith(".py"))
    if stray and args.command not in SCRIPT_COMMANDS:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.script_args = unknown + script_args  # a script's own options: hpc run -n 4 train.py --epochs 5
    try:
        if stray:
            raise ConfigError(f"unrecognized arguments: {show_text(' '.join(unknown))} (a script's own options go "
                              "after --)")
        return args.handler(args)
    except RankFailedError as exc:
        print(f"hpc: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except HpcError as exc:
        print(f"hpc: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        ranks = args.command in RANK_COMMANDS and "hpc.runtime.launch" in sys.modules
        print(f"hpc: interrupted{'; all ranks stopped' * ranks}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
