"""``hpc plan``: rank every (dp, tp, pp, microbatches, schedule, checkpointing) layout of a model on a cluster, on
paper (parallel/plan.py), and recommend the fastest that fits. Standard library only (no ranks are started) for the
built-in GPT and ``--model``; a spec's other model is read from its transformers config or counted on the meta
device (jobs/models/shape.py, torch and transformers imported then).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from hpc.config import show_text
from hpc.errors import ConfigError

MODEL_KEYS = {"layers": "layers", "hidden": "hidden", "heads": "heads", "seq": "seq_len", "vocab": "vocab",
              "kv_heads": "kv_heads", "ffn": "ffn", "gated": "gated", "tied": "tied"}  # the last four optional
REQUIRED_MODEL_KEYS = ("layers", "hidden", "heads", "seq", "vocab")
LAYOUT_KEYS = ("dp", "tp", "pp", "m", "schedule", "ckpt", "zero", "ep")  # --layout's, as Layout.label() spells them
# The spec keys hpc plan reads (--set of any other is refused): the GPT, the batch, the optimizer's bytes, the codec,
# the DP all-reduce's overlap and buckets; and the spec's own layout, which it ranks among the others. Every
# model.args.* key too (a model.entry's: jobs/models/shape.py reads its config or counts it).
SPEC_LAYOUT_KEYS = ("parallel.dp", "parallel.tp", "parallel.pp", "parallel.ep", "parallel.microbatches",
                    "parallel.schedule", "parallel.virtual_stages", "train.activation_checkpointing")
PLANNED_KEYS = ("model.kind", "model.entry", "model.n_layers", "model.d_model", "model.n_heads", "model.seq_len",
                "model.moe_experts", "model.moe_top_k", "model.moe_every", "data.batch_size", "train.optimizer",
                "train.momentum", "train.bf16_autocast", "parallel.compression", "parallel.topk_fraction",
                "parallel.powersgd_rank", "parallel.overlap", "parallel.bucket_mb", *SPEC_LAYOUT_KEYS)


def add_parser(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="predict step time and memory of every layout on a cluster, and "
                                            "recommend one (no ranks started)")
    plan.add_argument("spec", nargs="?", help="job spec (TOML): the built-in GPT, a jobs.models.hf:causal_lm "
                                              "(its config) or a model.entry counted on the meta device; or "
                                              "--model and --batch")
    plan.add_argument("--cluster",
                      help="cluster file (TOML), or a built-in one: a100-superpod, h100-dgx (parallel/clusters/)")
    plan.add_argument("--gpus", type=int, help="ranks to lay out")
    plan.add_argument("--model", metavar="K=V,...",
                      help="a GPT without a spec: layers=,hidden=,heads=,seq=,vocab= and optionally kv_heads= "
                           "(grouped-query attention), ffn= (the MLP's size, default 4 hidden), gated=1 (three MLP "
                           "matrices), tied=0 (an untied head); mixed-precision Adam")
    plan.add_argument("--batch", type=int, help="global batch in sequences (default: the spec's data.batch_size)")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a spec value the planner reads (repeatable; another key is refused; "
                           "--validate passes every one to hpc run)")
    plan.add_argument("--zero", action="store_true", help="also consider ZeRO stages 1, 2 and 3")
    plan.add_argument("--no-overlap", action="store_true", help="DP all-reduce after backward, not behind it")
    plan.add_argument("--checkpointing", choices=("any", "on", "off"), default="any",
                      help="activation checkpointing: consider both (default), or only on, or only off")
    plan.add_argument("--layout", metavar="dp=,tp=,pp=[,...]",
                      help="predict this layout alone: dp=,tp=,pp= and optionally m= (microbatches), schedule= "
                           "(1f1b, gpipe, interleaved, interleaved/V), ckpt=on|off, zero=0-3, ep=; what is left out "
                           "is chosen as the planner would (the fastest that fits); --gpus defaults to dp tp pp")
    plan.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    plan.add_argument("--json", action="store_true", help="the plan as one JSON object")
    plan.add_argument("--calibrate", action="store_true",
                      help="measure this machine (all-reduce alpha and beta with hpc bench allreduce's ring, a rank's "
                           "FLOP rate and memory bandwidth) and write a cluster file")
    plan.add_argument("--validate", action="store_true",
                      help="run layouts of the spec briefly with hpc run and print predicted (--cluster) against "
                           "measured step time and peak memory (jobs/bench/plan_check.py)")
    plan.add_argument("--layouts", help="--validate: comma-separated layout labels (default: all; see "
                                        "jobs/bench/plan_check.py)")
    plan.add_argument("--testbed", metavar="RATE", help="--validate on the namespace testbed (slurm/testbed/netns.py; "
                      "root): one rank per virtual host, links shaped to RATE, e.g. 1gbit; default layouts dp=2 and "
                      "dp=2 fp16, predicted with --cluster's node and the link at RATE")
    plan.add_argument("--steps", type=int, default=14, help="--validate: steps per run (default 14)")
    plan.add_argument("--warmup", type=int, default=4, help="--validate: first steps left out (default 4)")
    plan.add_argument("--repeats", type=int, default=3,
                      help="--validate: runs per layout, in rounds; a row's step time is the median of the runs' "
                           "medians; --calibrate: rounds of measurement, each constant their median (default 3)")
    plan.add_argument("--record", help="--validate: also write the cluster, the command, the load and every row "
                                       "to this JSON file (tests/test_plan.py checks docs/data/plan_local.json)")
    plan.add_argument("-n", "--nprocs", type=int, default=2, help="--calibrate: ranks of this node (default 2)")
    plan.add_argument("--out", default="runs/cluster-local.toml", help="--calibrate: the cluster file written "
                                                                       "(default %(default)s)")
    plan.add_argument("--launcher", choices=("local", "mpirun"), help="--calibrate: default mpirun when installed")
    plan.set_defaults(handler=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from parallel.cluster import load_cluster
    from parallel.plan import plan

    for option, value, wanted in (("--layout", args.layout, "dp=,tp=,pp=[,m=,schedule=,ckpt=,zero=,ep=]"),
                                  ("--layouts", args.layouts, "comma-separated layout labels")):
        if value is not None and not value.strip(" ,"):
            raise ConfigError(f"{option} is empty: give {wanted}, or leave the option out")
    if args.layout and (args.calibrate or args.validate):
        raise ConfigError("--layout predicts one layout; --calibrate and --validate do not take it "
                          "(--validate runs the layouts of --layouts)")
    if args.validate:
        return cmd_validate(args)  # every --set goes to the runs
    _check_overrides(args)
    if args.calibrate:
        return cmd_calibrate(args)
    want = _parse_layout(args) if args.layout else None
    if want is not None and args.gpus is None:
        args.gpus = want["dp"] * want["tp"] * want["pp"]
    if args.cluster is None or args.gpus is None:
        raise ConfigError("hpc plan needs --cluster and --gpus (or --calibrate to write a cluster file)")
    if args.gpus < 1 or args.top < 1:
        raise ConfigError(f"--gpus and --top must be at least 1, got {args.gpus} and {args.top}")
    model, train = _workload(args)
    cluster = load_cluster(args.cluster)
    if want is not None:
        return _plan_layout(args, model, train, cluster, want)
    result = plan(model, train, cluster, args.gpus, (0, 1, 2, 3) if args.zero else (0,))
    if args.checkpointing != "any":
        keep = tuple(e for e in result.fitting if e.layout.checkpointing == (args.checkpointing == "on"))
        result = replace(result, fitting=keep)
    _print_plan(args, model, train, cluster, result)
    if args.spec and result.fitting and not args.json:
        print(_spec_layout_line(args, result))
    return 0 if result.fitting else 1


def _print_plan(args: argparse.Namespace, model, train, cluster, result) -> None:
    """The plan as text or JSON; with --layout, the layout asked for and, when none of its layouts fits, the
    leanest of them."""
    if not args.json:
        print(_layout_text(args, model, train, cluster, result) if args.layout
              else _as_text(model, cluster, args.gpus, result, args.top))
        return
    out = _as_json(model, train, cluster, args.gpus, result, args.top)
    if args.layout:
        lean = result.leanest
        out.update(layout_asked=args.layout,
                   leanest={**asdict(lean), "shares": lean.shares()} if lean and not result.fitting else None)
    print(json.dumps(out))


def _check_overrides(args: argparse.Namespace) -> None:
    """Refuse a --set that hpc plan would ignore: every one without a job spec (--model, --calibrate), and with
    one a key it does not read; an unknown key or a bad value gets the spec's own message first."""
    from hpc.config import load_spec

    if args.overrides and args.spec and not args.calibrate:
        load_spec(args.spec, args.overrides)
    for override in args.overrides:
        key, shown = override.partition("=")[0].strip(), f"--set {show_text(override)}"
        if args.calibrate or not args.spec:
            hint = "" if args.calibrate else " (the layout of one prediction: --layout dp=,tp=,pp=)"
            raise ConfigError(f"{shown}: hpc plan {'--calibrate' if args.calibrate else '--model'} reads no job "
                              f"spec, so --set has nothing to change{hint}")
        if key == "parallel.zero":
            raise ConfigError(f"{shown}: hpc plan does not use parallel.zero (--zero considers every ZeRO stage; "
                              "--layout ...,zero=N predicts one)")
        if key not in PLANNED_KEYS and not key.startswith("model.args."):
            raise ConfigError(f"{shown}: hpc plan does not use {show_text(key)} (it reads {', '.join(PLANNED_KEYS)})")
        if args.layout and key in SPEC_LAYOUT_KEYS:
            raise ConfigError(f"{shown}: hpc plan --layout does not use the spec's layout; give it in --layout")
        if args.batch is not None and key == "data.batch_size":
            raise ConfigError(f"{shown}: --batch gives the batch; give one or the other")


def _plan_layout(args: argparse.Namespace, model, train, cluster, want: dict) -> int:
    """The layouts --layout names (one, when it gives every key), predicted and printed as hpc plan prints any."""
    from parallel.plan import plan

    problem = _layout_problem(model, train, want)
    if problem:
        raise ConfigError(f"--layout {show_text(args.layout)}: {problem}")
    zero = (want["zero"],) if "zero" in want else (0, 1, 2, 3) if args.zero else (0,)
    result = plan(model, train, cluster, args.gpus, zero, only=lambda lay: _matches(lay, want))
    if not result.considered:
        raise ConfigError(f"--layout {show_text(args.layout)}: no layout of {args.gpus} ranks the planner "
                          "considers matches it")
    _print_plan(args, model, train, cluster, result)
    return 0 if result.fitting else 1


def _parse_layout(args: argparse.Namespace) -> dict:
    """--layout dp=,tp=,pp=[,m=,schedule=,ckpt=,zero=,ep=] as {key: value}; schedule as (name, chunks or None)."""
    want: dict = {}
    for item in args.layout.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or key not in LAYOUT_KEYS:
            raise ConfigError(f"--layout {show_text(item)}: expected KEY=VALUE with KEY one of "
                              f"{', '.join(LAYOUT_KEYS)}")
        if key in want:
            raise ConfigError(f"--layout gives {key} twice")
        want[key] = _layout_value(key, value)
    missing = [key for key in ("dp", "tp", "pp") if key not in want]
    if missing:
        raise ConfigError(f"--layout is missing {', '.join(missing)} (give at least dp=,tp=,pp=)")
    if args.checkpointing != "any":
        if want.setdefault("ckpt", args.checkpointing == "on") != (args.checkpointing == "on"):
            raise ConfigError(f"--layout ckpt={'on' if want['ckpt'] else 'off'} contradicts --checkpointing "
                              f"{args.checkpointing}")
    if args.gpus is not None and want["dp"] * want["tp"] * want["pp"] != args.gpus:
        raise ConfigError(f"--layout dp={want['dp']} tp={want['tp']} pp={want['pp']} is "
                          f"{want['dp'] * want['tp'] * want['pp']} ranks, --gpus {args.gpus}")
    return want


def _layout_value(key: str, value: str):
    from parallel.plan import SCHEDULES

    if key == "schedule":
        name, slash, chunks = value.partition("/")
        if name not in SCHEDULES or (slash and (name != "interleaved" or not _digits(chunks) or int(chunks) < 2)):
            raise ConfigError(f"--layout schedule must be one of {', '.join(SCHEDULES)} or interleaved/V with V at "
                              f"least 2, got {show_text(value)}")
        return name, int(chunks) if slash else None
    if key == "ckpt":
        if value not in ("on", "off"):
            raise ConfigError(f"--layout ckpt must be on or off, got {show_text(value)}")
        return value == "on"
    low, high = (0, 3) if key == "zero" else (1, None)
    if not _digits(value) or int(value) < low or (high is not None and int(value) > high):
        wanted = "0, 1, 2 or 3" if key == "zero" else "a positive integer"
        raise ConfigError(f"--layout {key} must be {wanted}, got {show_text(value)}")
    return int(value)


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _layout_problem(model, train, want: dict) -> str | None:
    """Why no layout of the planner (parallel/plan.py's ``layouts``) can match ``want``, or None."""
    dp, tp, pp, m, ep = want["dp"], want["tp"], want["pp"], want.get("m"), want.get("ep", 1)
    name, chunks = want.get("schedule", ("1f1b", None))
    stage = model.layers // pp
    checks = (
        (model.heads % tp, f"tp={tp} does not divide the model's {model.heads} heads"),
        (model.kv % tp, f"tp={tp} does not divide the model's {model.kv} KV heads"),
        (model.layers % pp, f"pp={pp} does not divide the model's {model.layers} layers"),
        (train.batch % dp, f"dp={dp} does not divide the global batch of {train.batch} sequences"),
        (m and train.batch // dp % m, f"m={m} does not divide a replica's batch of {train.batch // dp} sequences"),
        (name != "1f1b" and pp == 1, f"schedule={name} needs a pipeline (pp > 1)"),
        (name == "interleaved" and m and m % pp, f"interleaved needs m a multiple of pp={pp}, got m={m}"),
        (name == "interleaved" and stage < 2, "interleaved needs at least 2 layers per stage"),
        (chunks and stage % chunks, f"interleaved/{chunks}: {chunks} does not divide a stage's {stage} layers"),
        (ep > 1 and not model.experts, f"ep={ep} needs a mixture of experts"),
        (ep > 1 and (dp % ep or model.experts % ep), f"ep={ep} must divide dp={dp} and the {model.experts} experts"),
        (want.get("zero") and dp == 1, "ZeRO shards over data parallelism: it needs dp > 1"),
    )
    return next((text for bad, text in checks if bad), None)


def _matches(lay, want: dict) -> bool:
    have = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "m": lay.microbatches, "ckpt": lay.checkpointing,
            "zero": lay.zero, "ep": lay.ep}
    for key, value in want.items():
        if key == "schedule":
            if lay.schedule != value[0] or (value[1] is not None and lay.virtual_stages != value[1]):
                return False
        elif have[key] != value:
            return False
    return True


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
    model = spec_transformer(spec)
    return model, _training(spec, args, model.hidden)


def spec_transformer(spec):
    """The planner's picture of a spec's model: the built-in GPT, its mixture of experts included, from the spec;
    any other from its config (jobs.models.hf:causal_lm) or counted on the meta device (jobs/models/shape.py)."""
    from parallel.plan import Transformer

    m = spec.model
    if m.entry or m.kind != "gpt":
        from jobs.models.shape import spec_model

        return spec_model(spec)
    return Transformer(m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size, experts=m.moe_experts,
                       top_k=m.moe_top_k, moe_every=m.moe_every)


def _training(spec, args: argparse.Namespace, hidden: int):
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
        ratio = min(1.0, 2 * spec.parallel.powersgd_rank / hidden)  # P and Q of h x h: 2 r / h
    batch = _positive("--batch", args.batch) if args.batch is not None else spec.data.batch_size
    return Training(batch=batch, dtype="bf16" if half else "fp32", act_bytes=2 if half else 4, param_bytes=4,
                    grad_bytes=4, optimizer_bytes=state, wire_ratio=ratio,
                    dp_overlap=spec.parallel.overlap and not args.no_overlap,
                    bucket_bytes=spec.parallel.bucket_mb * 2**20, p2p_split_over_tp=False)


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value}")
    return value


def _parse_model(text: str, transformer: type):
    """--model's K=V,... as a Transformer: positive integers, gated= and tied= 0 or 1; heads divide hidden and the KV
    heads divide the heads."""
    values = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in MODEL_KEYS:
            raise ConfigError(f"--model {show_text(item)}: expected KEY=VALUE with KEY one of {', '.join(MODEL_KEYS)}")
        flag = key in ("gated", "tied")
        if flag and value.strip() not in ("0", "1"):
            raise ConfigError(f"--model {key} must be 0 or 1, got {show_text(value)}")
        if not value.strip().isdigit() or (int(value) < 1 and not flag):
            raise ConfigError(f"--model {key} must be a positive integer, got {show_text(value)}")
        values[MODEL_KEYS[key]] = bool(int(value)) if flag else int(value)
    missing = [key for key in REQUIRED_MODEL_KEYS if MODEL_KEYS[key] not in values]
    if missing:
        raise ConfigError(f"--model is missing {', '.join(missing)} (give layers=,hidden=,heads=,seq=,vocab=)")
    if values["hidden"] % values["heads"]:
        raise ConfigError(f"--model hidden must be divisible by heads={values['heads']}, got {values['hidden']}")
    if values["heads"] % values.get("kv_heads", values["heads"]):
        raise ConfigError(f"--model kv_heads must divide heads={values['heads']}, got {values['kv_heads']}")
    return transformer(**values)


def _row(e) -> list[str]:
    from hpc.text import human_bytes

    shares = e.shares()
    step = f"{e.step_s:.3g} s" if e.step_s >= 1 else f"{e.step_s * 1e3:.3g} ms"
    return [e.layout.label(), step, f"{e.tokens_per_s:,.0f}", f"{e.tflops_per_gpu:.3g}",
            f"{e.mfu:.1%}", human_bytes(e.memory_bytes),
            *(f"{shares[part]:.0%}" for part in ("compute", "tp", "pp", "dp", "ep"))]


def _spec_layout_line(args: argparse.Namespace, result) -> str:
    """Where the spec's own [parallel] layout ranks among the fitting ones, and how much slower it is predicted."""
    from hpc.config import load_spec

    par, train = (spec := load_spec(args.spec, args.overrides)).parallel, spec.train
    dp = args.gpus // (par.tp * par.pp) if par.dp == "auto" else par.dp
    key = (dp, par.tp, par.pp, par.microbatches, par.schedule, par.virtual_stages if par.schedule == "interleaved"
           else 1, train.activation_checkpointing, par.ep)
    for place, e in enumerate(result.fitting, start=1):
        lay = e.layout
        if (lay.dp, lay.tp, lay.pp, lay.microbatches, lay.schedule, lay.virtual_stages, lay.checkpointing,
                lay.ep) == key:
            return (f"the spec's layout, {lay.label()}: number {place} of {len(result.fitting)}, predicted "
                    f"{e.step_s / result.fitting[0].step_s - 1:+.0%} against the recommended")
    return f"the spec's layout (dp={dp} tp={par.tp} pp={par.pp} m={par.microbatches} {par.schedule}) is not among " \
           f"the fitting layouts of {args.gpus} ranks"


HEADER = ["layout", "step", "tokens/s", "TFLOP/s/GPU", "MFU", "memory", "compute", "tp", "pp", "dp", "ep"]


def _head(model, cluster, gpus: int, result, layouts: str) -> str:
    from hpc.text import human_bytes

    count = f"{model.params / 1e9:.4g}B" if model.params >= 1e9 else f"{model.params / 1e6:.3g}M"
    return (f"{count}-parameter {model.name} ({_shape(model)}) on {gpus} x {cluster.name}: {layouts}, "
            f"{len(result.fitting)} fit in {human_bytes(result.capacity_bytes)} per rank")


def _shape(model) -> str:
    """The model in a few words: layers, hidden, heads (and KV heads), the MLP when not 4h, seq, window, experts."""
    parts = [f"{model.layers} layers", f"hidden {model.hidden}", f"{model.heads} heads"]
    if model.kv != model.heads:
        parts[-1] += f" and {model.kv} KV heads"
    if model.counted:
        parts.append("counted on the meta device")
    elif model.ffn or model.gated:
        parts.append(f"{'gated ' if model.gated else ''}MLP {model.intermediate}")
    parts.append(f"seq {model.seq_len}")
    if model.attended != model.seq_len:
        every = "" if model.window_layers in (0, model.layers) else f" on {model.window_layers} layers"
        parts.append(f"window {model.window}{every}")
    if not model.tied and not model.counted:
        parts.append("untied head")
    if model.experts:
        parts.append(f"{model.experts} experts top-{model.top_k} every {model.moe_every} layers")
    return ", ".join(parts)


def _as_text(model, cluster, gpus: int, result, top: int) -> str:
    from hpc.text import format_table, human_bytes

    head = _head(model, cluster, gpus, result, f"{result.considered} layouts")
    if not result.fitting:
        if result.leanest is None:
            return f"{head}\nno layout divides the model (tp | heads, pp | layers, dp | batch) on {gpus} ranks"
        lean = result.leanest
        return (f"{head}\nno layout fits: the leanest, {lean.layout.label()}, needs {human_bytes(lean.memory_bytes)}"
                f" per rank, {human_bytes(result.shortfall_bytes)} more than the usable "
                f"{human_bytes(result.capacity_bytes)}")
    table = format_table(HEADER, [_row(e) for e in result.fitting[:top]])
    return f"{head}\n{table}\nrecommended: {result.fitting[0].layout.label()}"


def _layout_text(args: argparse.Namespace, model, train, cluster, result) -> str:
    """--layout's rows: those that fit, fastest first, and where the fastest ranks among every layout; or the
    leanest, and by how much it misses."""
    from hpc.text import format_table, human_bytes

    n = result.considered
    asked = f"{n} layout{'s' * (n != 1)} match{'es' * (n == 1)} --layout {show_text(args.layout)}"
    head = _head(model, cluster, args.gpus, result, asked)
    table = format_table(HEADER, [_row(e) for e in result.fitting[: args.top] or (result.leanest,)])
    if result.fitting:
        return f"{head}\n{table}\n{_place_line(args, model, train, cluster, result.fitting[0])}"
    lean = result.leanest
    which = f"the leanest, {lean.layout.label()}," if n > 1 else lean.layout.label()
    return (f"{head}\n{table}\n{which} does not fit: it needs "
            f"{human_bytes(lean.memory_bytes)} per rank, {human_bytes(result.shortfall_bytes)} more than the usable "
            f"{human_bytes(result.capacity_bytes)}")


def _place_line(args: argparse.Namespace, model, train, cluster, chosen) -> str:
    """Where a layout ranks among every fitting layout of the ranks, and how much slower it is predicted."""
    from parallel.plan import plan

    fitting = plan(model, train, cluster, args.gpus, (0, 1, 2, 3) if args.zero or chosen.layout.zero else (0,)).fitting
    if args.checkpointing != "any":
        fitting = tuple(e for e in fitting if e.layout.checkpointing == (args.checkpointing == "on"))
    place = next(place for place, e in enumerate(fitting, start=1) if e.layout == chosen.layout)
    return (f"{chosen.layout.label()}: number {place} of the {len(fitting)} fitting layouts of {args.gpus} ranks, "
            f"predicted {chosen.step_s / fitting[0].step_s - 1:+.0%} against the recommended, "
            f"{fitting[0].layout.label()}")


def _as_json(model, train, cluster, gpus: int, result, top: int) -> dict:
    rows = [{**asdict(e), "shares": e.shares()} for e in result.fitting[:top]]
    return {"model": {**asdict(model), "params": model.params}, "training": asdict(train), "cluster": asdict(cluster),
            "gpus": gpus, "considered": result.considered, "fitting": len(result.fitting),
            "capacity_bytes": result.capacity_bytes, "shortfall_bytes": result.shortfall_bytes,
            "recommended": rows[0] if rows else None, "layouts": rows}


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure this node ``--repeats`` times and write a cluster file of each constant's median (one round of a
    busy 2-core VM moves a rate or a latency by 10-50%)."""
    import os
    import statistics
    from dataclasses import fields

    if args.nprocs < 2:
        raise ConfigError(f"--calibrate needs -n of at least 2 ranks (a ring), got {args.nprocs}")
    rounds = [_calibrate_round(args) for _ in range(_positive("--repeats", args.repeats))]
    measured = {f.name: [getattr(c, f.name) for c in rounds] for f in fields(rounds[0])
                if isinstance(getattr(rounds[0], f.name), float)}
    cluster = replace(rounds[0], **{name: statistics.median(values) for name, values in measured.items()})
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as handle:
        handle.write(cluster_toml(cluster))

    def spread(name: str, scale: float, unit: str) -> str:
        return f"{getattr(cluster, name) * scale:.4g} {unit} ({', '.join(f'{v * scale:.4g}' for v in measured[name])})"

    print(f"median of {len(rounds)} rounds (each round's in brackets): alpha {spread('intra_alpha_us', 1, 'us')}, "
          f"beta {spread('intra_gbps', 1, 'GB/s')} (ring over {args.nprocs} ranks); one core "
          f"{spread('peak_tflops_fp32', 1e3, 'GFLOP/s')} and {spread('layer_overhead_us', 1, 'us')} fixed per GPT "
          f"block forward+backward; {cluster.cores_per_node} threads {spread('thread_speedup', 1, 'x one')}; "
          f"copy {spread('memory_gbps', 1, 'GB/s')}; AdamW {spread('tensor_overhead_us', 1, 'us')} per tensor; "
          f"step {spread('step_overhead_ms', 1, 'ms')} fixed; rank base {cluster.rank_base_mib:.0f} MiB\n"
          f"wrote {args.out}")
    return 0


def _calibrate_round(args: argparse.Namespace):
    """One measurement of this node: the ring's alpha and beta fitted to ``hpc bench allreduce`` rows; on one
    core, a copy's bandwidth, a GPT block's fixed cost and FLOP rate fitted over several sizes and the optimizer's
    cost per tensor; the same blocks' rate on every core's thread (windows in turn with one thread's); and a
    one-rank run of a tiny GPT for a step's fixed cost and a rank's base memory."""
    import os

    from hpc.cli.bench import _bench_rank_argv
    from hpc.runtime import launch
    from jobs.bench.compute import measure_copy_gbps, measure_layers, measure_tensor_overhead
    from parallel.cluster import Cluster
    from parallel.plan import fit_alpha_beta

    options = ["--sizes", "4K,64K,1M,4M,16M", "--codecs", "none", "--transports", "torch", "--iters", "5"]
    rows = launch.launch_for_rows(args.nprocs, args.launcher or launch.default_launcher(),
                                  _bench_rank_argv("allreduce", options))
    alpha, beta = fit_alpha_beta([(r["bytes"], r["ranks"], r["time_s"]) for r in rows if r["impl"] == "ring"])
    cores = os.cpu_count() or 1
    copy_gbps = measure_copy_gbps()
    layers = measure_layers(threads=sorted({1, cores}))
    overhead, rate = _fit_layers([row for row in layers if row["threads"] == 1], copy_gbps)
    _, threaded_rate = _fit_layers([row for row in layers if row["threads"] == cores], copy_gbps)
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30) / args.nprocs
    tflops = rate / 1e12
    cluster = Cluster(
        name=f"{os.uname().nodename} ({cores} cores, CPU ranks)", source="hpc plan --calibrate",
        devices_per_node=max(64, cores), memory_gib=round(memory_gib, 2), peak_tflops_fp32=tflops,
        peak_tflops_tf32=tflops, peak_tflops_bf16=tflops, peak_tflops_fp16=tflops, matmul_efficiency=1.0,
        memory_gbps=copy_gbps, intra_alpha_us=alpha * 1e6, intra_gbps=beta / 1e9,
        inter_alpha_us=alpha * 1e6, inter_gbps=beta / 1e9, cores_per_node=cores,
        thread_speedup=min(float(cores), max(1.0, threaded_rate / rate)), layer_overhead_us=overhead * 1e6,
        tensor_overhead_us=measure_tensor_overhead() * 1e6)
    return _calibrate_floor(cluster, args.launcher)


def _fit_layers(rows: list[dict], memory_gbps: float) -> tuple[float, float]:
    """(fixed seconds, FLOP/s) of a block's forward and backward: its time less the elementwise bytes the planner
    charges at the copy bandwidth, fitted as fixed + 3 x layer FLOPs / rate."""
    from parallel.plan import Transformer, fit_overhead_and_rate

    samples = []
    for row in rows:
        layer = Transformer(1, row["hidden"], row["heads"], row["seq_len"], 256)
        tokens = row["batch"] * row["seq_len"]
        moved = 2 * layer.activation_bytes(tokens, 1, 4) / (memory_gbps * 1e9)
        samples.append((3 * layer.layer_flops(tokens), row["seconds"] - moved))
    return fit_overhead_and_rate(samples)


FLOOR = ("model.n_layers=1", "model.d_model=8", "model.n_heads=1", "model.seq_len=8", "data.batch_size=1",
         "parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1")


def _calibrate_floor(cluster, launcher: str | None):
    """A step's fixed cost and a rank's base memory, from one rank training a GPT too small to cost anything
    itself: its median step less what the planner already charges, and its peak resident set."""
    from jobs.bench.plan_check import Case, run_case

    spec = str(Path(__file__).resolve().parents[2] / "jobs" / "examples" / "gpt.toml")
    row = run_case(spec, Case("floor", 1, FLOOR), [], steps=24, warmup=4, launcher=launcher)
    charged = predict_case(spec, list(FLOOR), 1, cluster)
    return replace(cluster, step_overhead_ms=max(0.0, row["step_s"] - charged.step_s) * 1e3,
                   rank_base_mib=row["peak_bytes"] / 2**20)


def cluster_toml(cluster) -> str:
    """A cluster as the TOML ``--cluster`` reads back."""
    lines = ["# Written by hpc plan --calibrate: measured, not data-sheet figures.", "[cluster]"]
    for key, value in asdict(cluster).items():
        lines.append(f"{key} = {json.dumps(value if not isinstance(value, float) else round(value, 6))}")
    return "\n".join(lines) + "\n"


def predict_case(spec_path: str, overrides: list[str], nprocs: int, cluster):
    """The planner's estimate of ``spec_path`` with ``overrides`` run on ``nprocs`` ranks, as ``hpc run`` lays it
    out (dp = ranks / (tp pp))."""
    from hpc.config import load_spec
    from parallel.plan import Layout, estimate

    spec = load_spec(spec_path, overrides)
    par, model = spec.parallel, spec_transformer(spec)
    train = _training(spec, argparse.Namespace(batch=None, no_overlap=False), model.hidden)
    layout = Layout(nprocs // (par.tp * par.pp), par.tp, par.pp, par.microbatches, par.schedule,
                    par.virtual_stages if par.schedule == "interleaved" else 1, spec.train.activation_checkpointing,
                    par.zero, par.ep)
    return estimate(model, train, cluster, layout)


def compare(spec_path: str, rows: list[dict], cluster) -> list[dict]:
    """Each measured row with the prediction next to it and their ratios (predicted over measured)."""
    out = []
    for row in rows:
        e = predict_case(spec_path, row["overrides"], row["nprocs"], cluster)
        out.append({**row, "layout": e.layout.label(), "predicted_step_s": e.step_s,
                    "predicted_peak_bytes": e.memory_bytes, "step_ratio": e.step_s / row["step_s"],
                    "memory_ratio": e.memory_bytes / row["peak_bytes"]})
    return out


def validation_table(rows: list[dict]) -> str:
    from hpc.text import format_table

    header = ["layout", "ranks", "predicted", "measured", "ratio", "pred. memory", "measured", "ratio"]
    return format_table(header, [[r["label"], str(r["nprocs"]), f"{r['predicted_step_s'] * 1e3:.0f} ms",
                                  f"{r['step_s'] * 1e3:.0f} ms", f"{r['step_ratio']:.2f}",
                                  f"{r['predicted_peak_bytes'] / 2**20:.0f} MiB", f"{r['peak_bytes'] / 2**20:.0f} MiB",
                                  f"{r['memory_ratio']:.2f}"] for r in rows])


def testbed_cluster(cluster, rate: str, link: tuple[float, float] | None = None):
    """The namespace testbed as the planner sees it: one rank and one of this machine's cores per virtual host
    (computing at a core's share of the node's rate with every core busy), hosts joined by links shaped to
    ``rate`` (tc's units: 1gbit, 100mbit): at that rate and this node's alpha, or at ``link`` = (alpha s,
    beta B/s) when measured across the testbed."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    unit = next((u for u in units if rate.endswith(u)), None)
    if unit is None or not rate[: -len(unit)].replace(".", "", 1).isdigit():
        raise ConfigError(f"--testbed: expected a rate such as 1gbit or 100mbit, got {show_text(rate)}")
    alpha_us, gbps = cluster.inter_alpha_us, float(rate[: -len(unit)]) * units[unit] / 8 / 1e9
    if link is not None:
        alpha_us, gbps = link[0] * 1e6, link[1] / 1e9
    busy_core = cluster.core_share(cluster.cores_per_node) if cluster.cores_per_node else 1.0  # every core busy
    return replace(cluster, name=f"namespace testbed at {rate}", devices_per_node=1, cores_per_node=1,
                   thread_speedup=busy_core, inter_alpha_us=alpha_us, inter_gbps=gbps)


def cmd_validate(args: argparse.Namespace) -> int:
    """Run each layout, then print (and with --record keep) predicted against measured."""
    import os
    import sys

    from jobs.bench.plan_check import run_case, select
    from parallel.cluster import load_cluster

    if not args.spec or args.cluster is None:
        raise ConfigError("hpc plan --validate needs a job spec and --cluster (hpc plan --calibrate writes one)")
    if args.steps <= args.warmup:
        raise ConfigError(f"--steps must exceed --warmup, got {args.steps} and {args.warmup}")
    cluster = load_cluster(args.cluster)
    labels = args.layouts.split(",") if args.layouts else (["dp=2", "dp=2 fp16"] if args.testbed else None)
    try:
        cases = select(labels)
    except KeyError as error:
        raise ConfigError(f"--layouts: {error.args[0]}") from None
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}")
    load = [os.getloadavg()[0]]
    if args.testbed:
        cluster, measured = _validate_on_testbed(args, cases, cluster, load)
    else:
        measured = _in_rounds(args.repeats, cases, load, lambda case: run_case(
            args.spec, case, list(args.overrides), args.steps, args.warmup, args.launcher))
    rows = compare(args.spec, measured, cluster)
    record = {"command": "hpc plan " + " ".join(sys.argv[2:]), "spec": args.spec, "cluster": asdict(cluster),
              "load_1min": load, "cpus": os.cpu_count(), "rows": rows}
    if args.record:
        with open(args.record, "w") as handle:
            handle.write(json.dumps(record, indent=1) + "\n")
    if args.json:
        print(json.dumps(record))
    else:
        print(f"{validation_table(rows)}\nload average (1 min) during the runs: "
              f"{min(load):.1f} to {max(load):.1f} on {os.cpu_count()} CPUs")
    return 0


def _validate_on_testbed(args: argparse.Namespace, cases, cluster, load: list[float]):
    """The testbed's link measured first (our ring's alpha and beta across it, as --calibrate measures this node's),
    then each case: (the cluster the predictions use, the measured rows)."""
    from jobs.bench.plan_check import Testbed
    from parallel.plan import fit_alpha_beta

    with Testbed(max(case.nprocs for case in cases), args.testbed) as bed:
        rows = bed.ring_rows("4K,64K,1M,4M,16M")
        link = fit_alpha_beta([(r["bytes"], r["ranks"], r["time_s"]) for r in rows if r["impl"] == "ring"])
        measured = _in_rounds(args.repeats, cases, load, lambda case: bed.run_case(
            args.spec, case, list(args.overrides), args.steps, args.warmup))
    return testbed_cluster(cluster, args.testbed, link), measured


def _in_rounds(repeats: int, cases, load: list[float], measure) -> list[dict]:
    """Every case once per round, ``repeats`` rounds (a slow minute of the machine then touches one run of each
    case, not every run of one), merged per case; the load average after each run is appended to ``load``."""
    import os

    from jobs.bench.plan_check import merge_repeats

    runs: list[list[dict]] = [[] for _ in cases]
    for _ in range(repeats):
        for index, case in enumerate(cases):
            runs[index].append(measure(case))
            load.append(os.getloadavg()[0])
    return [merge_repeats(case_runs) for case_runs in runs]
