"""What ``hpc plan`` prints: the table of layouts, ``--layout``'s rows and where they rank, the spec's own layout's
place, the plan as one JSON object. Standard library only, like the planner (parallel/plan.py)."""

from __future__ import annotations

from dataclasses import asdict

from hpc.config import show_text
from hpc.text import format_table, human_bytes

HEADER = ["layout", "step", "tokens/s", "TFLOP/s/GPU", "MFU", "memory", "compute", "tp", "pp", "dp", "ep"]


def _row(e) -> list[str]:
    shares = e.shares()
    step = f"{e.step_s:.3g} s" if e.step_s >= 1 else f"{e.step_s * 1e3:.3g} ms"
    return [e.layout.label(), step, f"{e.tokens_per_s:,.0f}", f"{e.tflops_per_gpu:.3g}",
            f"{e.mfu:.1%}", human_bytes(e.memory_bytes),
            *(f"{shares[part]:.0%}" for part in ("compute", "tp", "pp", "dp", "ep"))]


def _head(model, cluster, gpus: int, result, layouts: str) -> str:
    count = f"{model.params / 1e9:.4g}B" if model.params >= 1e9 else f"{model.params / 1e6:.3g}M"
    return (f"{count}-parameter {model.name} ({shape(model)}) on {gpus} x {cluster.name}: {layouts}, "
            f"{len(result.fitting)} fit in {human_bytes(result.capacity_bytes)} per rank")


def shape(model) -> str:
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


def plan_text(model, cluster, gpus: int, result, top: int) -> str:
    """The fitting layouts, fastest first, and the recommended one; or why none fits."""
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


def layout_text(model, cluster, gpus: int, result, top: int, asked: str, every: tuple) -> str:
    """--layout's rows: those that fit, fastest first, and where the fastest ranks among ``every`` fitting layout
    of the ranks; or the leanest, and by how much it misses."""
    n = result.considered
    head = _head(model, cluster, gpus, result, f"{n} layout{'s' * (n != 1)} match{'es' * (n == 1)} --layout "
                                               f"{show_text(asked)}")
    table = format_table(HEADER, [_row(e) for e in result.fitting[:top] or (result.leanest,)])
    if result.fitting:
        chosen = result.fitting[0]
        place = next(place for place, e in enumerate(every, start=1) if e.layout == chosen.layout)
        return (f"{head}\n{table}\n{chosen.layout.label()}: number {place} of the {len(every)} fitting layouts of "
                f"{gpus} ranks, predicted {chosen.step_s / every[0].step_s - 1:+.0%} against the recommended, "
                f"{every[0].layout.label()}")
    lean = result.leanest
    which = f"the leanest, {lean.layout.label()}," if n > 1 else lean.layout.label()
    return (f"{head}\n{table}\n{which} does not fit: it needs "
            f"{human_bytes(lean.memory_bytes)} per rank, {human_bytes(result.shortfall_bytes)} more than the usable "
            f"{human_bytes(result.capacity_bytes)}")


def spec_layout_line(lay, result, gpus: int) -> str:
    """Where the spec's own [parallel] layout ``lay`` (any ZeRO stage) ranks among the fitting ones, and how much
    slower it is predicted."""
    for place, e in enumerate(result.fitting, start=1):
        if asdict(e.layout) | {"zero": 0} == asdict(lay) | {"zero": 0}:
            return (f"the spec's layout, {e.layout.label()}: number {place} of {len(result.fitting)}, predicted "
                    f"{e.step_s / result.fitting[0].step_s - 1:+.0%} against the recommended")
    return (f"the spec's layout (dp={lay.dp} tp={lay.tp} pp={lay.pp} m={lay.microbatches} {lay.schedule}) is not "
            f"among the fitting layouts of {gpus} ranks")


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def compression_line(advice: dict | None) -> str:
    """What ``parallel.plan.compression_advice`` says, in one line."""
    if advice is None:
        return "compression: nothing fits to compare"
    exact = advice["uncompressed_step_s"]
    if advice["codec"] == "none":
        best, seconds = min(advice["steps"].items(), key=lambda item: item[1])
        return (f"compression: none pays here (the fastest, {best}, saves {1 - seconds / exact:.0%} of the best "
                f"uncompressed step, {_duration(exact)})")
    where = "across nodes only" if advice["scope"] == "inter-node" else "on every hop"
    return (f"compression: {advice['codec']} {where} pays: {advice['layout']} with parallel.compression = "
            f"\"{advice['codec']}\", compression_scope = \"{advice['scope']}\", {_duration(advice['step_s'])} a "
            f"step against {_duration(exact)} uncompressed ({advice['step_s'] / exact - 1:+.0%})")


def plan_json(model, train, cluster, gpus: int, result, top: int, asked: str | None) -> dict:
    """The plan as one JSON object; with --layout (``asked``), that and, when none of its layouts fits, the
    leanest."""
    rows = [{**asdict(e), "shares": e.shares()} for e in result.fitting[:top]]
    out = {"model": {**asdict(model), "params": model.params}, "training": asdict(train), "cluster": asdict(cluster),
           "gpus": gpus, "considered": result.considered, "fitting": len(result.fitting),
           "capacity_bytes": result.capacity_bytes, "shortfall_bytes": result.shortfall_bytes,
           "recommended": rows[0] if rows else None, "layouts": rows,
           "compression": advice(model, train, cluster, gpus, result)}
    if asked:
        lean = result.leanest
        out.update(layout_asked=asked,
                   leanest={**asdict(lean), "shares": lean.shares()} if lean and not result.fitting else None)
    return out


def advice(model, train, cluster, gpus: int, result) -> dict | None:
    """``compression_advice`` over the plan's ZeRO stages; None when nothing fits."""
    from parallel.plan import compression_advice

    if not result.fitting:
        return None
    zero = (0, 1, 2, 3) if any(e.layout.zero for e in result.fitting) else (0,)
    return compression_advice(model, train, cluster, gpus, zero)
