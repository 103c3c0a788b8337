"""Whether a job spec can run on a (dp, tp, pp) mesh: checked by ``hpc run`` before launch and by every rank.

Torch-free for the built-in models (``hpc submit`` runs it on a login node): it combines
the model's cut, the pipeline schedule's validation (``parallel.schedule.build_schedule``)
and the batch arithmetic, so a layout that cannot work is one error line and no process
is started. A user's model (``model.entry``) is built on torch's meta device to check its
TP plan and pipeline blocks (``jobs.models.protocol.check_model_layout``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc.errors import ConfigError, LayoutError

if TYPE_CHECKING:
    from hpc.config import JobSpec, ParallelConfig
    from hpc.runtime.mesh import MeshShape

DATA_OF_MODEL = {"mlp": "digits", "gpt": "licenses"}


def uses_pipeline(parallel: ParallelConfig) -> bool:
    """Steps run through the pipeline executor: several stages, or several microbatches to accumulate."""
    return parallel.pp > 1 or parallel.virtual_stages > 1 or parallel.microbatches > 1


def check_layout(spec: JobSpec, world_size: int) -> MeshShape:
    """The mesh shape of ``spec`` on ``world_size`` ranks, with the model's cut, schedule, batch split, expert
    groups, ``checkpoint.init_from`` and ``train.health_cluster`` checked (``parallel.dp = "auto"`` is known only
    here): what ``hpc run`` (``--dry-run`` too), ``hpc submit`` and ``hpc sweep`` check before anything starts."""
    from hpc.runtime.mesh import expert_group_ranks, resolve_layout

    shape = resolve_layout(spec.parallel.dp, spec.parallel.tp, spec.parallel.pp, world_size)
    if spec.train.float8 != "off" and spec.parallel.device == "cpu":
        raise ConfigError(f"train.float8={spec.train.float8!r}: Float8 matmuls need an NVIDIA GPU of compute "
                          "capability 8.9 or newer; parallel.device='cpu' (set train.float8='off')")
    model = check_job_layout(spec, shape)
    expert_group_ranks(shape, spec.parallel.ep)
    if spec.train.health_cluster:  # read now: a missing file is one line before anything starts, not at step 0
        from parallel.cluster import load_cluster

        try:
            load_cluster(spec.train.health_cluster)
        except ConfigError as exc:
            raise ConfigError(f"train.health_cluster: {exc}") from None
    check_run_dir(spec)
    if spec.checkpoint.init_from:
        from jobs.train.checkpointing import check_init_from  # torch and h5py: only when a checkpoint is to be read

        check_init_from(spec, model)
    return shape


def check_run_dir(spec: JobSpec) -> None:
    """The run's directory can be made: a file in its way would fail every rank once started. (A
    ``checkpoint.resume`` path is not checked here: a job submitted to follow another may name the checkpoint
    that one will write.)"""
    existing = next(path for path in (spec.run_path, *spec.run_path.parents) if path.exists() or path == path.parent)
    if not existing.is_dir():
        raise ConfigError(f"job.run_dir={spec.job.run_dir}: {existing} is a file, not a directory (the run's "
                          f"directory is {spec.run_path})")


def check_this_machine(spec: JobSpec) -> None:
    """``hpc run`` of ranks on this machine: a GPU asked for (``parallel.device = "cuda"``, ``parallel.backend =
    "nccl"``) where none is visible, or ``train.float8`` where they would compute on its CPU, on a GPU without FP8,
    or without torchao (``jobs.train.float8``), refused before launch; each rank checks again."""
    par = spec.parallel
    if par.device == "cuda" or par.backend == "nccl":
        from hpc.runtime.bootstrap import select_backend

        select_backend(par.backend, par.device)
    if spec.train.float8 == "off":
        return
    import torch

    from jobs.train.float8 import float8_refusal

    gpu = spec.parallel.device != "cpu" and torch.cuda.is_available()
    refusal = float8_refusal(spec.train.float8, torch.device("cuda", 0) if gpu else torch.device("cpu"))
    if refusal:
        raise ConfigError(refusal)


def check_job_layout(spec: JobSpec, shape: MeshShape) -> Any:
    """Raise ``ConfigError``/``LayoutError`` naming the numbers when ``spec`` cannot train on ``shape``; returns
    the model built on the meta device to check it (a ``model.entry``), else None."""
    from hpc.entry import load_entry
    from jobs.models.protocol import check_model_layout
    from parallel.schedule import build_schedule

    par, model = spec.parallel, None
    if not spec.model.entry and not spec.data.entry and spec.data.name != DATA_OF_MODEL[spec.model.kind]:
        raise ConfigError(f"model.kind={spec.model.kind!r} trains on data.name={DATA_OF_MODEL[spec.model.kind]!r}, "
                          f"got {spec.data.name!r}")
    m = par.microbatches
    if spec.data.batch_size % (shape.dp * m):
        split = f"dp={shape.dp}" if m == 1 else f"dp * parallel.microbatches = {shape.dp}*{m} = {shape.dp * m}"
        raise LayoutError(f"data.batch_size={spec.data.batch_size} is not divisible by {split}")
    if spec.model.entry:
        model = check_model_layout(spec, shape.tp, shape.pp, par.virtual_stages)  # builds it on meta: torch
    else:
        _check_builtin_model(spec, shape)
    if spec.data.entry:
        load_entry(spec.data.entry, "data.entry")
        check_token_set(spec, model)  # a prepared token set: whole, its ids within the model's vocabulary
    if uses_pipeline(par):
        build_schedule(par.schedule, shape.pp, m, par.virtual_stages)
    return model


def _check_builtin_model(spec: JobSpec, shape: MeshShape) -> None:
    """The built-in models' cuts, without torch (``hpc submit`` on a login node): the numbers their
    ``tp_plan``, ``tp_divisors`` and ``pipeline_parts`` would be checked against."""
    model, chunks = spec.model, shape.pp * spec.parallel.virtual_stages
    if model.kind == "mlp":
        if shape.tp > 1 or chunks > 1:
            raise LayoutError(f"model.kind='mlp' has no tp_plan and no pipeline_parts: parallel.tp and "
                              f"pp * virtual_stages must be 1, got {shape.tp} and {chunks}")
        if spec.train.activation_checkpointing:
            raise ConfigError("train.activation_checkpointing recomputes the model's blocks: model.kind='mlp' "
                              "has none (pipeline_parts)")
        if spec.train.fused_head_loss:
            raise ConfigError("train.fused_head_loss fuses an LM head with its loss: model.kind='mlp' is a "
                              "classifier (jobs.models.hf's causal LMs and model.kind='gpt' have one)")
        return
    if model.n_heads % shape.tp:
        raise LayoutError(f"model.n_heads={model.n_heads} is not divisible by parallel.tp={shape.tp} "
                          "(attention is split by heads)")
    if model.vocab_size % shape.tp:
        raise LayoutError(f"the vocabulary of {model.vocab_size} tokens is not divisible by parallel.tp={shape.tp} "
                          "(the embedding and the LM head are split by vocabulary)")
    if model.n_layers % chunks:
        raise LayoutError(f"model.n_layers={model.n_layers} is not divisible by parallel.pp * virtual stages = "
                          f"{shape.pp}*{spec.parallel.virtual_stages} = {chunks}")


def built_vocab(spec: JobSpec, model: Any = None) -> int | None:
    """The input embedding's rows of the model built on the meta device (no memory), for a spec whose
    ``[model.args]`` do not say (a transformers model from ``pretrained``'s config); ``model``: that build,
    when the caller has it."""
    import torch

    from jobs.models.protocol import build_model

    if model is None:
        with torch.device("meta"):
            model = build_model(spec)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else next(
        (module for module in model.modules() if isinstance(module, torch.nn.Embedding)), None)
    return getattr(embedding, "num_embeddings", None)



def check_token_set(spec: JobSpec, model: Any = None) -> None:
    """Before any rank starts: a token set's directory is whole (``TokenSet``), its ids fit the model's vocabulary
    and ``[data.args]`` split it (``model``: the spec's model built on the meta device, when the caller has it)."""
    from hpc.entry import call_entry
    from jobs.data.tokens import TOKENS_ENTRY, check_vocab, entry_args, model_window, read_meta, tokens

    if spec.data.entry != TOKENS_ENTRY:
        return
    path = spec.data.args.get("path")
    if not isinstance(path, str):
        raise ConfigError(f"data.entry={TOKENS_ENTRY!r} needs data.args.path = the directory hpc data prepare wrote")
    args = entry_args(spec)  # refuses data.args.vocab_size
    _, vocab, where = model_window(spec)
    if vocab is None:
        vocab, where = built_vocab(spec, model), "input embedding"
    check_vocab(read_meta(path), path, vocab, where)
    call_entry(tokens, args, TOKENS_ENTRY, "data.entry")  # the files, their ids, the held-out split
