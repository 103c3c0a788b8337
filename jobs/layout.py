"""Whether a job spec can run on a (dp, tp, pp) mesh: checked by ``hpc run`` before launch and by every rank.

Pure and torch-free (``hpc run`` imports it on the login node): it only combines the
model's own check (``jobs.parallelize.check_gpt_layout``), the pipeline schedule's
validation (``parallel.schedule.build_schedule``) and the batch arithmetic, so a layout
that cannot work is one error line and no process is started.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpc.errors import ConfigError, LayoutError

if TYPE_CHECKING:
    from hpc.config import JobSpec, ParallelConfig
    from hpc.runtime.mesh import MeshShape

DATA_OF_MODEL = {"mlp": "digits", "gpt": "licenses"}


def uses_pipeline(parallel: ParallelConfig) -> bool:
    """Steps run through the pipeline executor: several stages, or several microbatches to accumulate."""
    return parallel.pp > 1 or parallel.virtual_stages > 1 or parallel.microbatches > 1


def check_layout(spec: JobSpec, world_size: int) -> MeshShape:
    """The mesh shape of ``spec`` on ``world_size`` ranks, with the model's cut, schedule and batch split checked."""
    from hpc.runtime.mesh import resolve_layout

    shape = resolve_layout(spec.parallel.dp, spec.parallel.tp, spec.parallel.pp, world_size)
    check_job_layout(spec, shape)
    return shape


def check_job_layout(spec: JobSpec, shape: MeshShape) -> None:
    """Raise ``ConfigError``/``LayoutError`` naming the numbers when ``spec`` cannot train on ``shape``."""
    from jobs.parallelize import check_gpt_layout
    from parallel.schedule import build_schedule

    par, model = spec.parallel, spec.model
    if spec.data.name != DATA_OF_MODEL[model.kind]:
        raise ConfigError(
            f"model.kind={model.kind!r} trains on data.name={DATA_OF_MODEL[model.kind]!r}, got {spec.data.name!r}"
        )
    m = par.microbatches
    if spec.data.batch_size % (shape.dp * m):
        split = f"dp={shape.dp}" if m == 1 else f"dp * parallel.microbatches = {shape.dp}*{m} = {shape.dp * m}"
        raise LayoutError(f"data.batch_size={spec.data.batch_size} is not divisible by {split}")
    if model.kind == "mlp":
        if (shape.tp, shape.pp, par.virtual_stages, m) != (1, 1, 1, 1):
            raise LayoutError(
                f"model.kind='mlp' trains data-parallel only: parallel.tp, pp, virtual_stages and microbatches "
                f"must be 1, got {shape.tp}, {shape.pp}, {par.virtual_stages}, {m} (the GPT takes them)"
            )
        if spec.train.activation_checkpointing:
            raise ConfigError("train.activation_checkpointing recomputes transformer blocks: it needs model.kind='gpt'")
        return
    check_gpt_layout(model, shape.tp, shape.pp, par.virtual_stages)
    if uses_pipeline(par):
        build_schedule(par.schedule, shape.pp, m, par.virtual_stages)
