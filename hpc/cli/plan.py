"""``hpc plan``: rank every (dp, tp, pp, microbatches, schedule, checkpointing) layout of a model on a cluster, on
paper (parallel/plan.py), and recommend the fastest that fits; ``--calibrate`` and ``--validate`` measure this machine
(jobs/bench/calibrate.py, jobs/bench/plan_check.py). Standard library only (no ranks are started) for the built-in
GPT and ``--model``; a spec's other model is read from its transformers config or counted on the meta device
(jobs/models/shape.py, torch and transformers imported then). What it prints: hpc/cli/plan_text.py;
--calibrate and --validate: hpc/cli/plan_measure.py.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from hpc.cli import plan_measure, plan_text
from hpc.config import show_text
from hpc.errors import ConfigError

MODEL_KEYS = {"layers": "layers", "hidden": "hidden", "heads": "heads", "seq": "seq_len", "vocab": "vocab",
              "kv_heads": "kv_heads", "ffn": "ffn", "gated": "gated", "tied": "tied"}  # the last four optional
REQUIRED_MODEL_KEYS = ("layers", "hidden", "heads", "seq", "vocab")
LAYOUT_KEYS = ("dp", "tp", "pp", "m", "schedule", "ckpt", "zero", "ep")  # --layout's, as Layout.label() spells them
RECOMPUTE_OF = {"off": "", "selective": "selective", "on": "full"}  # --checkpointing and ckpt=: Layout.checkpointing


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
    plan.add_argument("--checkpointing", choices=("any", *RECOMPUTE_OF), default="any",
                      help="activation checkpointing: consider every choice (default), or only off, selective "
                           "(train.recompute = 'selective': the products kept) or on (full recomputation)")
    plan.add_argument("--layout", metavar="dp=,tp=,pp=[,...]",
                      help="predict this layout alone: dp=,tp=,pp= and optionally m= (microbatches), schedule= "
                           "(1f1b, gpipe, interleaved, interleaved/V), ckpt=off|selective|on, zero=0-3, ep=; what "
                           "is left out is chosen as the planner would (the fastest that fits); --gpus defaults to "
                           "dp tp pp")
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
                      "root): one rank per virtual host (the 2x2 layouts: nodes of 2 ranks, a link per rank), links "
                      "shaped to RATE, e.g. 1gbit; default layouts dp=2 and dp=2 fp16, predicted with --cluster's node "
                      "and the links as measured there")
    plan.add_argument("--steps", type=int, default=14, help="--validate: steps per run (default 14)")
    plan.add_argument("--warmup", type=int, default=4, help="--validate: first steps left out (default 4)")
    plan.add_argument("--repeats", type=int, default=3,
                      help="--validate: runs per layout, in rounds; a row's step time is the median of the runs' "
                           "medians (--testbed: each link the median of as many fits); --calibrate: rounds of "
                           "measurement, each constant their median (default 3)")
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
        return plan_measure.cmd_validate(args)  # every --set goes to the runs
    _check_overrides(args)
    if args.calibrate:
        return plan_measure.cmd_calibrate(args)
    want = _parse_layout(args) if args.layout else None
    if want is not None and args.gpus is None:
        args.gpus = want["dp"] * want["tp"] * want["pp"]
    if args.cluster is None or args.gpus is None:
        raise ConfigError("hpc plan needs --cluster and --gpus (or --calibrate to write a cluster file)")
    if args.gpus < 1 or args.top < 1:
        raise ConfigError(f"--gpus and --top must be at least 1, got {args.gpus} and {args.top}")
    spec, model, train = _workload(args)
    cluster = load_cluster(args.cluster)
    if want is not None:
        return _plan_layout(args, model, train, cluster, want)
    result = _checkpointing(args, plan(model, train, cluster, args.gpus, (0, 1, 2, 3) if args.zero else (0,)))
    _print_plan(args, model, train, cluster, result)
    if result.fitting and not args.json:
        print(plan_text.compression_line(plan_text.advice(model, train, cluster, args.gpus, result)))
    if spec is not None and result.fitting and not args.json:
        from parallel.plan import spec_layout

        print(plan_text.spec_layout_line(spec_layout(spec, args.gpus), result, args.gpus))
    return 0 if result.fitting else 1


def _checkpointing(args: argparse.Namespace, result):
    """The plan with only the fitting layouts --checkpointing allows."""
    if args.checkpointing == "any":
        return result
    return replace(result, fitting=tuple(e for e in result.fitting
                                         if e.layout.checkpointing == RECOMPUTE_OF[args.checkpointing]))


def _print_plan(args: argparse.Namespace, model, train, cluster, result) -> None:
    """The plan as text or JSON; with --layout, the layouts asked for, and where the fastest of them ranks among
    every fitting layout of the ranks."""
    from parallel.plan import plan

    if args.json:
        print(json.dumps(plan_text.plan_json(model, train, cluster, args.gpus, result, args.top, args.layout)))
    elif not args.layout:
        print(plan_text.plan_text(model, cluster, args.gpus, result, args.top))
    else:
        zero = (0, 1, 2, 3) if args.zero or (result.fitting and result.fitting[0].layout.zero) else (0,)
        every = _checkpointing(args, plan(model, train, cluster, args.gpus, zero)).fitting if result.fitting else ()
        print(plan_text.layout_text(model, cluster, args.gpus, result, args.top, args.layout, every))


def _check_overrides(args: argparse.Namespace) -> None:
    """Refuse a --set that hpc plan would ignore: every one without a job spec (--model, --calibrate), and with
    one a key it does not read; an unknown key or a bad value gets the spec's own message first."""
    from hpc.config import load_spec
    from parallel.plan import PLANNED_KEYS, SPEC_LAYOUT_KEYS

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
    from parallel.plan import layout_problem, matches, plan

    problem = layout_problem(model, train, want)
    if problem:
        raise ConfigError(f"--layout {show_text(args.layout)}: {problem}")
    zero = (want["zero"],) if "zero" in want else (0, 1, 2, 3) if args.zero else (0,)
    result = plan(model, train, cluster, args.gpus, zero, only=lambda lay: matches(lay, want))
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
        if want.setdefault("ckpt", RECOMPUTE_OF[args.checkpointing]) != RECOMPUTE_OF[args.checkpointing]:
            given = next(name for name, recompute in RECOMPUTE_OF.items() if recompute == want["ckpt"])
            raise ConfigError(f"--layout ckpt={given} contradicts --checkpointing {args.checkpointing}")
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
        if value not in RECOMPUTE_OF:
            raise ConfigError(f"--layout ckpt must be off, selective or on, got {show_text(value)}")
        return RECOMPUTE_OF[value]
    low, high = (0, 3) if key == "zero" else (1, None)
    if not _digits(value) or int(value) < low or (high is not None and int(value) > high):
        wanted = "0, 1, 2 or 3" if key == "zero" else "a positive integer"
        raise ConfigError(f"--layout {key} must be {wanted}, got {show_text(value)}")
    return int(value)


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _workload(args: argparse.Namespace):
    """(the job spec or None, Transformer, Training) from --model and --batch, or from a job spec."""
    from parallel.plan import MIXED_ADAM, Transformer

    if args.model:
        if args.spec:
            raise ConfigError("give a job spec or --model, not both")
        if args.batch is None:
            raise ConfigError("--model needs --batch (the global batch in sequences)")
        return None, _parse_model(args.model, Transformer), replace(
            MIXED_ADAM, batch=_positive("--batch", args.batch), dp_overlap=not args.no_overlap)
    if not args.spec:
        raise ConfigError("hpc plan needs a job spec or --model layers=,hidden=,heads=,seq=,vocab=")
    from hpc.config import load_spec
    from jobs.models.shape import spec_model
    from parallel.plan import spec_training

    spec = load_spec(args.spec, args.overrides)
    model = spec_model(spec)
    batch = _positive("--batch", args.batch) if args.batch is not None else None
    return spec, model, spec_training(spec, model.hidden, batch, overlap=not args.no_overlap)


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
