"""``hpc plan``: rank every (dp, tp, pp, microbatches, schedule, checkpointing) layout of a GPT on a cluster, on
paper (parallel/plan.py), and recommend the fastest that fits. Standard library only: no ranks are started.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

from hpc.config import show_text
from hpc.errors import ConfigError

MODEL_KEYS = {"layers": "layers", "hidden": "hidden", "heads": "heads", "seq": "seq_len", "vocab": "vocab"}


def add_parser(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="predict step time and memory of every layout on a cluster, and "
                                            "recommend one (no ranks started)")
    plan.add_argument("spec", nargs="?", help="job spec (TOML) with model.kind = \"gpt\"; or give --model and --batch")
    plan.add_argument("--cluster",
                      help="cluster file (TOML), or a built-in one: a100-superpod, h100-dgx (parallel/clusters/)")
    plan.add_argument("--gpus", type=int, help="ranks to lay out")
    plan.add_argument("--model", metavar="K=V,...",
                      help="a GPT without a spec: layers=,hidden=,heads=,seq=,vocab= (mixed-precision Adam)")
    plan.add_argument("--batch", type=int, help="global batch in sequences (default: the spec's data.batch_size)")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a spec value (repeatable)")
    plan.add_argument("--zero", action="store_true", help="also consider ZeRO stages 1, 2 and 3")
    plan.add_argument("--no-overlap", action="store_true", help="DP all-reduce after backward, not behind it")
    plan.add_argument("--checkpointing", choices=("any", "on", "off"), default="any",
                      help="activation checkpointing: consider both (default), or only on, or only off")
    plan.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    plan.add_argument("--json", action="store_true", help="the plan as one JSON object")
    plan.add_argument("--calibrate", action="store_true",
                      help="measure this machine (all-reduce alpha and beta with hpc bench allreduce's ring, a rank's "
                           "FLOP rate and memory bandwidth) and write a cluster file")
    plan.add_argument("-n", "--nprocs", type=int, default=2, help="--calibrate: ranks of this node (default 2)")
    plan.add_argument("--out", default="runs/cluster-local.toml", help="--calibrate: the cluster file written "
                                                                       "(default %(default)s)")
    plan.add_argument("--launcher", choices=("local", "mpirun"), help="--calibrate: default mpirun when installed")
    plan.set_defaults(handler=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from parallel.cluster import load_cluster
    from parallel.plan import plan

    if args.calibrate:
        return cmd_calibrate(args)
    if args.cluster is None or args.gpus is None:
        raise ConfigError("hpc plan needs --cluster and --gpus (or --calibrate to write a cluster file)")
    if args.gpus < 1 or args.top < 1:
        raise ConfigError(f"--gpus and --top must be at least 1, got {args.gpus} and {args.top}")
    model, train = _workload(args)
    cluster = load_cluster(args.cluster)
    result = plan(model, train, cluster, args.gpus, (0, 1, 2, 3) if args.zero else (0,))
    if args.checkpointing != "any":
        keep = tuple(e for e in result.fitting if e.layout.checkpointing == (args.checkpointing == "on"))
        result = replace(result, fitting=keep)
    if args.json:
        print(json.dumps(_as_json(model, train, cluster, args.gpus, result, args.top)))
    else:
        print(_as_text(model, cluster, args.gpus, result, args.top))
        if args.spec and result.fitting:
            print(_spec_layout_line(args, result))
    return 0 if result.fitting else 1


def _workload(args: argparse.Namespace):
    """(Transformer, Training) from --model and --batch, or from a GPT job spec."""
    from parallel.plan import MIXED_ADAM, Transformer

    if args.model:
        if args.spec:
            raise ConfigError("give a job spec or --model, not both")
        if args.batch is None:
            raise ConfigError("--model needs --batch (the global batch in sequences)")
        return _parse_model(args.model, Transformer), replace(MIXED_ADAM, batch=_positive("--batch", args.batch),
                                                              dp_overlap=not args.no_overlap)
    if not args.spec:
        raise ConfigError("hpc plan needs a job spec or --model layers=,hidden=,heads=,seq=,vocab=")
    from hpc.config import load_spec

    spec = load_spec(args.spec, args.overrides)
    if spec.model.entry or spec.model.kind != "gpt":
        raise ConfigError(f"{show_text(args.spec)}: hpc plan models the built-in GPT (model.kind = \"gpt\"); "
                          "for another model give --model")
    model = Transformer(spec.model.n_layers, spec.model.d_model, spec.model.n_heads, spec.model.seq_len,
                        spec.model.vocab_size)
    return model, _training(spec, args)


def _training(spec, args: argparse.Namespace):
    """Our training loop's bytes: fp32 weights and gradients, the optimizer's state, the codec's wire ratio."""
    from parallel.plan import Training

    half = spec.train.bf16_autocast
    state = {"adam": 8, "adamw": 8, "lamb": 8, "lars": 4,  # bytes per parameter: moments, momentum
             "sgd": 4 if spec.train.momentum else 0}[spec.train.optimizer]
    codec = spec.parallel.compression
    ratio = {"fp16": 0.5, "bf16": 0.5, "int8": 0.25}.get(codec, 1.0)
    if codec == "topk":
        ratio = 2 * spec.parallel.topk_fraction  # values and indices; first order, see docs/PLANNER.md
    if codec == "powersgd":
        ratio = min(1.0, 2 * spec.parallel.powersgd_rank / spec.model.d_model)  # P and Q of h x h: 2 r / h
    batch = _positive("--batch", args.batch) if args.batch is not None else spec.data.batch_size
    return Training(batch=batch, dtype="bf16" if half else "fp32", act_bytes=2 if half else 4, param_bytes=4,
                    grad_bytes=4, optimizer_bytes=state, wire_ratio=ratio,
                    dp_overlap=spec.parallel.overlap and not args.no_overlap)


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value}")
    return value


def _parse_model(text: str, transformer: type):
    values = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in MODEL_KEYS:
            raise ConfigError(f"--model {show_text(item)}: expected KEY=VALUE with KEY one of {', '.join(MODEL_KEYS)}")
        if not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"--model {key} must be a positive integer, got {show_text(value)}")
        values[MODEL_KEYS[key]] = int(value)
    missing = [key for key, name in MODEL_KEYS.items() if name not in values]
    if missing:
        raise ConfigError(f"--model is missing {', '.join(missing)} (give layers=,hidden=,heads=,seq=,vocab=)")
    if values["hidden"] % values["heads"]:
        raise ConfigError(f"--model hidden must be divisible by heads={values['heads']}, got {values['hidden']}")
    return transformer(**values)


def _row(e) -> list[str]:
    from hpc.text import human_bytes

    shares = e.shares()
    step = f"{e.step_s:.3g} s" if e.step_s >= 1 else f"{e.step_s * 1e3:.3g} ms"
    return [e.layout.label(), step, f"{e.tokens_per_s:,.0f}", f"{e.tflops_per_gpu:.3g}",
            f"{e.mfu:.1%}", human_bytes(e.memory_bytes),
            *(f"{shares[part]:.0%}" for part in ("compute", "tp", "pp", "dp"))]


def _spec_layout_line(args: argparse.Namespace, result) -> str:
    """Where the spec's own [parallel] layout ranks among the fitting ones, and how much slower it is predicted."""
    from hpc.config import load_spec

    par, train = (spec := load_spec(args.spec, args.overrides)).parallel, spec.train
    dp = args.gpus // (par.tp * par.pp) if par.dp == "auto" else par.dp
    key = (dp, par.tp, par.pp, par.microbatches, par.schedule, par.virtual_stages if par.schedule == "interleaved"
           else 1, train.activation_checkpointing)
    for place, e in enumerate(result.fitting, start=1):
        lay = e.layout
        if (lay.dp, lay.tp, lay.pp, lay.microbatches, lay.schedule, lay.virtual_stages, lay.checkpointing) == key:
            return (f"the spec's layout, {lay.label()}: number {place} of {len(result.fitting)}, predicted "
                    f"{e.step_s / result.fitting[0].step_s - 1:+.0%} against the recommended")
    return f"the spec's layout (dp={dp} tp={par.tp} pp={par.pp} m={par.microbatches} {par.schedule}) is not among " \
           f"the fitting layouts of {args.gpus} ranks"


def _as_text(model, cluster, gpus: int, result, top: int) -> str:
    from hpc.text import format_table, human_bytes

    count = f"{model.params / 1e9:.4g}B" if model.params >= 1e9 else f"{model.params / 1e6:.3g}M"
    head = (f"{count}-parameter GPT ({model.layers} layers, hidden {model.hidden}, {model.heads} "
            f"heads, seq {model.seq_len}) on {gpus} x {cluster.name}: {result.considered} layouts, "
            f"{len(result.fitting)} fit in {human_bytes(result.capacity_bytes)} per rank")
    if not result.fitting:
        if result.leanest is None:
            return f"{head}\nno layout divides the model (tp | heads, pp | layers, dp | batch) on {gpus} ranks"
        lean = result.leanest
        return (f"{head}\nno layout fits: the leanest, {lean.layout.label()}, needs {human_bytes(lean.memory_bytes)}"
                f" per rank, {human_bytes(result.shortfall_bytes)} more than the usable "
                f"{human_bytes(result.capacity_bytes)}")
    header = ["layout", "step", "tokens/s", "TFLOP/s/GPU", "MFU", "memory", "compute", "tp", "pp", "dp"]
    table = format_table(header, [_row(e) for e in result.fitting[:top]])
    return f"{head}\n{table}\nrecommended: {result.fitting[0].layout.label()}"


def _as_json(model, train, cluster, gpus: int, result, top: int) -> dict:
    rows = [{**asdict(e), "shares": e.shares()} for e in result.fitting[:top]]
    return {"model": {**asdict(model), "params": model.params}, "training": asdict(train), "cluster": asdict(cluster),
            "gpus": gpus, "considered": result.considered, "fitting": len(result.fitting),
            "capacity_bytes": result.capacity_bytes, "shortfall_bytes": result.shortfall_bytes,
            "recommended": rows[0] if rows else None, "layouts": rows}


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure this node and write a cluster file: the ring's alpha and beta fitted to ``hpc bench allreduce``
    rows, one rank's fp32 FLOP rate and copy bandwidth with the cores shared as the ranks would share them."""
    import os

    from hpc.cli.bench import _bench_rank_argv
    from hpc.runtime import launch
    from jobs.bench.compute import measure_compute
    from parallel.cluster import Cluster
    from parallel.plan import fit_alpha_beta

    if args.nprocs < 2:
        raise ConfigError(f"--calibrate needs -n of at least 2 ranks (a ring), got {args.nprocs}")
    options = ["--sizes", "4K,64K,1M,4M,16M", "--codecs", "none", "--transports", "torch", "--iters", "5"]
    rows = launch.launch_for_rows(args.nprocs, args.launcher or launch.default_launcher(),
                                  _bench_rank_argv("allreduce", options))
    alpha, beta = fit_alpha_beta([(r["bytes"], r["ranks"], r["time_s"]) for r in rows if r["impl"] == "ring"])
    cores = os.cpu_count() or 1
    rank = measure_compute(threads=max(1, cores // args.nprocs))
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30) / args.nprocs
    flops = rank["tflops_fp32"]
    cluster = Cluster(
        name=f"{os.uname().nodename} ({args.nprocs} CPU ranks)", source="hpc plan --calibrate",
        devices_per_node=args.nprocs, memory_gib=round(memory_gib, 2), peak_tflops_fp32=flops, peak_tflops_tf32=flops,
        peak_tflops_bf16=flops, peak_tflops_fp16=flops, matmul_efficiency=1.0, memory_gbps=rank["memory_gbps"],
        intra_alpha_us=alpha * 1e6, intra_gbps=beta / 1e9, inter_alpha_us=alpha * 1e6, inter_gbps=beta / 1e9)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as handle:
        handle.write(cluster_toml(cluster))
    print(f"alpha {alpha * 1e6:.1f} us, beta {beta / 1e9:.3f} GB/s (ring over {args.nprocs} ranks), "
          f"{flops * 1e3:.1f} GFLOP/s fp32 and {rank['memory_gbps']:.1f} GB/s per rank\nwrote {args.out}")
    return 0


def cluster_toml(cluster) -> str:
    """A cluster as the TOML ``--cluster`` reads back."""
    lines = ["# Written by hpc plan --calibrate: measured, not data-sheet figures.", "[cluster]"]
    for key, value in asdict(cluster).items():
        lines.append(f"{key} = {json.dumps(value if not isinstance(value, float) else round(value, 6))}")
    return "\n".join(lines) + "\n"
