"""Job spec: one TOML file drives local runs, mpirun and Slurm alike.

Sections are frozen dataclasses so a spec can be hashed, compared and stored in
checkpoints. They are filled by one builder driven by the type hints and the
field metadata, so adding a setting is one line here and every error message
(dotted path, bad value, valid choices) comes for free. Standard library only:
this is imported on login nodes and by ``hpc --help``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import operator
import os
import re
import shlex
import stat
import tomllib
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeAlias, Union, get_args, get_origin, get_type_hints

from hpc.errors import ConfigError
from hpc.rundir import CHECKPOINTS_DIR

# The gradient codecs, named here (standard library only) so that a spec validates without torch;
# parallel/compression/registry.py implements exactly these.
CodecName: TypeAlias = Literal["none", "fp16", "bf16", "int8", "topk", "powersgd"]
CODEC_NAMES: tuple[str, ...] = get_args(CodecName)

_UNIONS = (Union, types.UnionType)
_BOUNDS = (
    ("min", operator.ge, ">="),
    ("gt", operator.gt, ">"),
    ("max_excl", operator.lt, "<"),
    ("max", operator.le, "<="),
)
_NOUNS = types.MappingProxyType(
    {bool: "boolean", int: "integer", float: "number", str: "string"}
)
_SLURM_WORD = types.MappingProxyType(
    {"pattern": r"\S*", "describe": "empty or a single word without spaces"}
)
_PATH = types.MappingProxyType({"max_len": 4096, "max_part_bytes": 255})  # PATH_MAX, NAME_MAX
_ENTRY = types.MappingProxyType(
    {"pattern": r"(?:[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)?",
     "describe": "empty or 'package.module:function'"}
)
_NO_TABLE: Mapping[str, Any] = types.MappingProxyType({})

# Input limits (issue 16): what a spec, a sweep file or a --set may hold, each refused in one line.
MAX_DEPTH = 32  # tables and arrays nested in a file or a --set (tomllib recurses: thousands overflow the stack)
MAX_FILE_BYTES = 1 << 20  # a job spec or a sweep file: 1 MiB
MAX_STRING = 1024  # characters of a string setting without a max_len of its own
MAX_SWEEP_CONFIGS = 1000  # a sweep's configs: a Slurm job array's default MaxArraySize is 1001 (indices 0-1000)
ECHO_LIMIT = 80  # characters of a bad value or override echoed in an error
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# What can hold a bracket without nesting (strings, comments), and the brackets themselves.
_TOKENS = re.compile("|".join((
    r'"""(?:[^\\]|\\.)*?"""', r"'''.*?'''", r'"(?:[^"\\\n]|\\.)*"', r"'[^'\n]*'", r"#[^\n]*", r"[][{}]",
)), re.DOTALL)


def _field(default: Any, doc: str, **constraints: Any) -> Any:
    """A setting: its default, what it means (``hpc spec`` and docs/JOB_SPEC.md print it) and the
    constraints the builder checks (min, gt, max_excl, max, pattern, describe; for strings max_len,
    default MAX_STRING, max_part_bytes per '/'-separated part, shell_words: shlex must split it)."""
    if isinstance(default, Mapping):  # a table: dataclasses refuse an unhashable default
        return field(default_factory=lambda: default, metadata={"doc": doc, **constraints})
    return field(default=default, metadata={"doc": doc, **constraints})


@dataclass(frozen=True)
class JobConfig:
    """The job's name, seed and run directory."""

    name: str = _field(
        "job", "the job's name: Slurm's job name and the run directory <run_dir>/<name>; at most 128 characters",
        pattern=r"[A-Za-z0-9][A-Za-z0-9._-]*",
        describe="letters, digits, '.', '_' or '-', starting with a letter or digit", max_len=128,
    )
    seed: int = _field(0, "seeds the model's initialization, the batches and dropout: same seed, same run", min=0,
                       max=2**64 - 1)  # torch.manual_seed's range
    run_dir: str = _field("runs", "where runs keep their directories (metrics, checkpoints, logs); shared by the nodes",
                          **_PATH)


@dataclass(frozen=True)
class ModelConfig:
    """The model: your own (entry) or a built-in MLP or GPT."""

    vocab_size: ClassVar[int] = 256  # the GPT reads raw bytes

    entry: str = _field("", "your model: a function 'package.module:function' returning an nn.Module that follows "
                            "docs/USER_MODELS.md; empty: the built-in model.kind", **_ENTRY)
    args: Mapping[str, Any] = _field(_NO_TABLE, "entry: its keyword arguments")
    tp_plan: Mapping[str, str] = _field(
        _NO_TABLE, "module-name patterns ('*' for one name) to a TP style (colwise, rowwise, vocab, replicate, ...), "
                   "over the model's own tp_plan")
    kind: Literal["mlp", "gpt"] = _field("mlp", "without entry: mlp, the digits classifier, or gpt, the byte-level "
                                                "GPT (jobs/models/gpt.py)")
    hidden_sizes: tuple[int, ...] = _field((128, 128), "mlp: the width of each hidden layer", min=1)
    dropout: float = _field(0.0, "dropout probability after each hidden layer or block", min=0, max_excl=1)
    n_layers: int = _field(4, "gpt: transformer blocks (cut into pipeline stages)", min=1)
    n_heads: int = _field(4, "gpt: attention heads (split over tensor-parallel ranks)", min=1)
    d_model: int = _field(128, "gpt: width of the residual stream", min=1)
    seq_len: int = _field(64, "gpt: tokens (bytes) per sample", min=1)
    moe_experts: int = _field(0, "gpt: experts of each mixture-of-experts feed-forward (jobs/models/moe.py); "
                                 "0 = dense", min=0)
    moe_top_k: int = _field(1, "gpt: experts each token is sent to (1: Switch, 2: GShard)", min=1, max=2)
    moe_every: int = _field(1, "gpt: every moe_every-th block (the moe_every-th, 2*moe_every-th, ...) is MoE", min=1)
    moe_capacity_factor: float = _field(
        1.25, "gpt: each expert takes at most ceil(factor * top_k * seq_len / moe_experts) tokens of a sequence; "
              "the rest are dropped (the residual carries them)", gt=0)
    moe_aux_loss_coef: float = _field(0.01, "gpt: weight of the Switch Transformer load-balancing loss", min=0)
    moe_z_loss_coef: float = _field(0.0, "gpt: weight of the router z-loss (ST-MoE); 0 = off", min=0)

    def field_conflict(self) -> tuple[str, str] | None:
        """(field, what it must be) when fields disagree; the builder adds the path and value."""
        if self.d_model % self.n_heads:
            return "d_model", f"divisible by n_heads={self.n_heads}"
        if self.moe_experts and (self.entry or self.kind != "gpt"):
            return "moe_experts", ("0 with model.entry (your model builds its own jobs.models.moe.MoE layers)"
                                   if self.entry
                                   else f"0 for model.kind={self.kind!r} (only the gpt has MoE blocks)")
        if self.moe_experts and self.moe_top_k > self.moe_experts:
            return "moe_top_k", f"at most moe_experts={self.moe_experts}"
        if self.moe_experts and self.moe_every > self.n_layers:
            return "moe_every", f"at most n_layers={self.n_layers} (else no block is MoE)"
        return None


@dataclass(frozen=True)
class DataConfig:
    """The data set and the global batch."""

    entry: str = _field("", "your data: a function 'package.module:function' returning a map-style data set "
                            "(docs/USER_MODELS.md); empty: the built-in data.name", **_ENTRY)
    args: Mapping[str, Any] = _field(_NO_TABLE, "entry: its keyword arguments")
    name: Literal["digits", "licenses"] = _field(
        "digits", "without entry: digits, scikit-learn's handwritten digits (mlp), or licenses, Debian's license "
                  "texts (gpt)")
    batch_size: int = _field(64, "the global batch, split across the data-parallel ranks", min=1)


@dataclass(frozen=True)
class TrainConfig:
    """The training loop, its optimizer and what it observes."""

    renamed_keys: ClassVar[Mapping[str, str]] = types.MappingProxyType({"schedule": "lr_schedule"})

    steps: int = _field(100, "optimizer steps of the run", min=1)
    lr: float = _field(0.1, "peak learning rate (after warmup_steps, before lr_schedule's decay)", gt=0)
    optimizer: Literal["sgd", "adam", "adamw", "lamb", "lars"] = _field(
        "sgd", "the optimizer every rank steps: torch's sgd, adam, adamw, or lamb and lars, layer-wise trust ratios "
               "for large batches (parallel/large_batch.py)")
    momentum: float = _field(0.0, "sgd and lars: momentum (top-k compression applies sgd's to the sparsified "
                                  "velocity)", min=0, max_excl=1)
    trust_coefficient: float = _field(0.001, "lars: eta, the layer-wise learning rate is eta * ||w|| / "
                                             "(||g|| + weight_decay * ||w||)", gt=0)
    weight_decay: float = _field(0.0, "weight decay (decoupled for adamw)", min=0)
    grad_clip: float = _field(0.0, "clip the global gradient norm, across TP and PP ranks, to this; 0 = off", min=0)
    freeze: tuple[str, ...] = _field(
        (), "parameters not trained (fine-tuning): fnmatch patterns over the single-device model's parameter "
            "names, '*' crossing dots ('embedding.*', 'model.embed_tokens.*', 'blocks.[01].*'); what matches gets no "
            "gradient, optimizer state or clipping share, and is still saved and loaded; a pattern matching no "
            "parameter is an error")
    warmup_steps: int = _field(0, "linear learning-rate warm-up from lr/warmup_steps to lr", min=0)
    lr_schedule: Literal["constant", "cosine"] = _field(
        "constant", "the learning rate after warm-up: constant, or cosine decay to zero at the last step")
    log_every: int = _field(10, "steps between progress lines (rank 0)", min=1)
    lr_reference_batch: int = _field(
        0, "the global batch lr was tuned for: lr is scaled by data.batch_size / lr_reference_batch "
           "(linear scaling, Goyal et al. 2017); 0 = off", min=0)
    bf16_autocast: bool = _field(False, "forward (loss excluded) under torch.autocast with bfloat16")
    activation_checkpointing: bool = _field(False, "recompute each GPT block's activations in backward")
    recompute: Literal["full", "selective"] = _field(
        "full", "with activation_checkpointing: full recomputes each block's whole forward in backward; selective "
                "keeps the outputs of the matrix products and attention and recomputes only the cheap elementwise "
                "ops between them (norms, activations, rotary, residual adds): torchtitan's op-level selective "
                "checkpointing")
    float8: Literal["off", "rowwise", "tensorwise"] = _field(
        "off", "the blocks' matmuls in Float8 through torchao (jobs/train/float8.py): rowwise or tensorwise "
               "scaling; the LM head and MoE routers stay bf16; needs a GPU of compute capability 8.9+ and torchao")
    fused_head_loss: bool = _field(
        False, "the LM head and the loss computed together, a chunk of tokens at a time: the logits are never "
               "whole in memory (a model with an lm_head: jobs.models.hf; under TP split over the vocabulary)")
    compile: bool = _field(False, "torch.compile each layer of this rank's stages (each transformer block, the "
                                  "embedding, the head; a model with no pipeline parts whole), as torchtitan does")
    timeline: bool = _field(False, "Chrome-trace spans of every rank in <run_path>/timeline.json (hpc/observe)")
    profile_steps: int = _field(0, "torch.profiler over this many steps after the first 3: each rank's trace and "
                                   "its ops by device time in <run_path>/profile/ (hpc/observe/profile.py); 0 = off",
                                min=0)
    stall_warn_s: float = _field(
        60.0, "a rank waiting this long in a collective or pipeline receive reports who has not arrived", gt=0)
    stall_abort_s: float = _field(240.0, "past this wait the job aborts with that report instead of hanging", gt=0)
    health_check: bool = _field(False, "before training: each node writes its run directory and scratch and finds "
                                       "its GPU free, then every group of the mesh all-reduces and passes a ring of "
                                       "messages; a failing node is named (and excluded by a restart with spares)")
    health_check_timeout_s: float = _field(30.0, "how long the health check waits for each group", gt=0)
    health_cluster: str = _field("", "with health_check: a cluster file (hpc plan --cluster: a name or a path) whose "
                                     "links the measured ring links must reach a quarter of (its alpha-beta time "
                                     "for the message, times 4); empty: no comparison", **_PATH)
    straggler_every: int = _field(0, "every this many steps the ranks compare their step compute times "
                                     "(hpc/observe/straggler.py); 0 = off", min=0)
    straggler_threshold: float = _field(1.25, "a rank computing above this many times the median rank's step, two "
                                              "comparisons running, is named as a straggler", gt=1)

    def field_conflict(self) -> tuple[str, str] | None:
        if self.recompute == "selective" and not self.activation_checkpointing:
            return "recompute", ("'full' without train.activation_checkpointing = true (it chooses what the "
                                 "checkpointed blocks recompute)")
        if self.stall_abort_s <= self.stall_warn_s:
            return "stall_abort_s", f"greater than stall_warn_s={self.stall_warn_s:g}"
        return None


@dataclass(frozen=True)
class ParallelConfig:
    """The (dp, tp, pp) layout and data-parallel communication."""

    dp: int | Literal["auto"] = _field("auto", "data-parallel replicas; auto: the world size / (tp * pp)", min=1)
    tp: int = _field(1, "tensor-parallel ranks per layer (heads, MLP and vocabulary split)", min=1)
    pp: int = _field(1, "pipeline stages the blocks are cut into", min=1)
    ep: int = _field(1, "expert-parallel ranks: the experts sharded over groups of ep data-parallel ranks, tokens "
                        "sent to them by all-to-all (parallel/ep.py); must divide dp and model.moe_experts", min=1)
    microbatches: int = _field(1, "microbatches per step and replica; interleaved needs a multiple of pp", min=1)
    schedule: Literal["gpipe", "1f1b", "interleaved"] = _field(
        "1f1b", "the pipeline schedule (parallel/schedule.py)")
    virtual_stages: int = _field(1, "model chunks per pipeline rank (interleaved only)", min=1)
    backend: Literal["auto", "gloo", "nccl"] = _field("auto", "torch.distributed backend; auto: NCCL when the device "
                                                             "is a GPU, else Gloo; gloo with device cuda lets several "
                                                             "ranks share one GPU")
    device: Literal["auto", "cpu", "cuda"] = _field("auto", "where each rank computes: auto is its GPU when CUDA is "
                                                           "present (local rank modulo the GPUs), else the CPU")
    compression: Literal[CodecName] = _field(
        "none", "the gradient codec inside the ring, with error feedback (docs/PARALLELISM.md: gradient compression)")
    topk_fraction: float = _field(0.01, "topk: the fraction of each gradient's entries sent", gt=0, max=1)
    powersgd_rank: int = _field(4, "powersgd: the rank of the P Q^T approximation", min=1)
    compression_warmup_steps: int = _field(0, "exact reduction for this many steps before compression starts", min=0)
    compression_scope: Literal["auto", "flat", "inter-node"] = _field(
        "auto", "where the codec runs: flat, one ring over every DP rank; inter-node, reduce-scattered inside each "
        "node uncompressed, the codec across nodes on each rank's shard, gathered inside the node "
        "(parallel/hierarchy.py); auto: inter-node when the DP group spans several nodes and a codec is set")
    transport: Literal["torch", "mpi"] = _field(
        "torch", "the ring's and the pipeline's point-to-point messages: torch (Gloo/NCCL) or mpi (mpi4py; needs "
        "mpirun or srun; on CPU the faster: shared memory, no progress thread competing with compute)")
    bucket_mb: float = _field(25.0, "gradient fusion: MiB per bucket reduced as one message", gt=0)
    overlap: bool = _field(True, "reduce buckets while backward still runs")
    zero: int = _field(
        0, "ZeRO stage over each data-parallel group: 0 = every replica keeps the whole optimizer state; 1 = each "
           "keeps its share, whole parameters assigned greedily by size (parallel/zero.py); 2 = gradients too, each "
           "bucket reduce-scattered through the ring to its owners (top-k and powersgd: all-reduced, then "
           "others' dropped); 3 = parameters too, each bucket gathered before its forward and backward and freed "
           "after", min=0, max=3)
    init_timeout_s: float = _field(60.0, "a rank that cannot join the rendezvous in this time fails, naming itself",
                                   gt=0)
    timeout_s: float = _field(300.0, "the backend's timeout for one collective", gt=0)

    def field_conflict(self) -> tuple[str, str] | None:
        if isinstance(self.dp, int) and self.dp % self.ep:
            return "ep", f"a divisor of dp={self.dp} (expert-parallel groups are carved out of the DP ranks)"
        if self.backend == "nccl" and self.device == "cpu":
            return "backend", "'gloo' or 'auto' with device='cpu' (NCCL moves GPU memory only)"
        return None


@dataclass(frozen=True)
class CheckpointConfig:
    """Sharded HDF5 checkpoints and resume."""

    dir: str = _field("", "where checkpoints go; empty: <run_path>/checkpoints", **_PATH)
    every_steps: int = _field(0, "save every this many steps, and after the last; 0 = off", min=0)
    keep: int = _field(3, "newest complete checkpoints kept", min=1)
    local_every_steps: int = _field(0, "also save every this many steps to each node's own disk (local_dir), each "
                                       "shard copied to the next node; a restart resumes from the newer of the two "
                                       "tiers; 0 = off", min=0)
    local_keep: int = _field(2, "newest local checkpoints each node keeps", min=1)
    local_dir: str = _field("", "where each node keeps the local tier (a node-local disk); empty: $SLURM_TMPDIR, "
                                "else the temporary directory", **_PATH)
    async_save: bool = _field(False, "the loop waits only for a copy to host memory; files are written behind it")
    resume: str = _field(
        "auto", "auto: the newest complete checkpoint if any; never (starts over, the checkpoints already there set "
        "aside in earlier-<time>/); or a checkpoint path",
        pattern=r".+", describe="'auto', 'never' or a checkpoint path", **_PATH
    )
    init_from: str = _field(
        "", "fine-tuning: the model's weights (only) from another run's checkpoint, a step directory or a directory "
            "of checkpoints (its newest), saved under any layout; the run starts at step 0 with fresh optimizer "
            "state, RNG and learning-rate schedule (warm-up and decay counted from this run's first step). A "
            "checkpoint of this run's own that resume finds (a requeue) comes first and continues where it "
            "stopped; empty: off", **_PATH)

    def field_conflict(self) -> tuple[str, str] | None:
        if self.init_from in ("auto", "never"):
            return "init_from", "a checkpoint path (a step directory or a directory of checkpoints), or empty"
        if self.init_from and self.resume not in ("auto", "never"):
            return "resume", ("'auto' or 'never' with init_from set (a path to resume from continues that run: "
                              "its step, optimizer state and schedule)")
        return None


@dataclass(frozen=True)
class SlurmConfig:
    """Resources for hpc submit and hpc sweep."""

    nodes: int = _field(1, "nodes (sbatch --nodes)", min=1)
    ntasks_per_node: int = _field(0, "ranks per node; 0: one per GPU asked for (gpus_per_node), else 1", min=0)
    gpus_per_node: int = _field(0, "GPUs per node; 0: none asked for", min=0)
    gpus_per_task: int = _field(0, "GPUs per rank, each rank bound to its own (srun --gpus-per-task); 0: none "
                                   "asked for", min=0)
    cpus_per_task: int = _field(1, "CPUs per rank", min=1)
    mem: str = _field(
        "", "memory per node; empty: the partition's default",
        pattern=r"(?:[0-9]+[KMGT]?)?",
        describe="empty or a Slurm memory size like 16G, 500M or 1T",
    )
    partition: str = _field("", "partition; empty: the cluster's default", **_SLURM_WORD)
    time: str = _field(
        "01:00:00", "time limit, above zero (Slurm reads 0 as no limit: give a real one)",
        pattern=r"(?=.*[1-9])(?:[0-9]+(?::[0-9]{1,2}){0,2}|[0-9]+-[0-9]{1,2}(?::[0-9]{1,2}){0,2})",
        describe="a Slurm time limit above zero (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)",
    )
    account: str = _field("", "account to charge", **_SLURM_WORD)
    qos: str = _field("", "quality of service", **_SLURM_WORD)
    constraint: str = _field("", "node features, e.g. a100", **_SLURM_WORD)
    setup: tuple[str, ...] = _field((), "shell lines run in the batch script before the ranks start (literal words)",
                                    shell_words=True)
    signal_delay_s: int = _field(120, "SIGUSR1 this many seconds before the time limit: checkpoint and requeue",
                                 min=0)
    max_requeues: int = _field(3, "requeues after a warning signal before the job just stops", min=0)
    max_restarts: int = _field(0, "times a failed or hung job step runs again inside the same allocation, from the "
                                  "newest checkpoint (a user's error is not retried: slurm/restart.py)", min=0)
    spare_nodes: int = _field(0, "nodes allocated beyond slurm.nodes: a node whose rank died is excluded from the "
                                 "next restart and a spare takes its place", min=0)
    elastic: bool = _field(False, "with no spare node left, a restart runs on the nodes that remain: fewer "
                                  "data-parallel ranks, the same global batch (data.batch_size)")

    @property
    def tasks_per_node(self) -> int:
        """The ranks a node runs: ``ntasks_per_node``, by default one per GPU asked for (a rank per GPU, as
        torchrun's ``--nproc-per-node=gpu``), else 1."""
        return self.ntasks_per_node or self.gpus_per_node or 1

    def field_conflict(self) -> tuple[str, str] | None:
        """A node's ranks binding more GPUs than it asks for: Slurm would hold the job pending or refuse it."""
        wanted = self.gpus_per_task * self.tasks_per_node
        if self.gpus_per_node and wanted > self.gpus_per_node:
            return "gpus_per_task", (f"at most gpus_per_node / tasks per node = {self.gpus_per_node}/"
                                     f"{self.tasks_per_node} ({self.tasks_per_node} ranks a node would bind {wanted} "
                                     f"GPUs of the {self.gpus_per_node} asked for)")
        return None


@dataclass(frozen=True)
class JobSpec:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def field_conflict(self) -> tuple[str, str] | None:
        """Settings of different tables that disagree (dotted field, what it must be)."""
        ep, experts = self.parallel.ep, self.model.moe_experts
        # a model.entry's own MoE layers are checked when the trainer shards them
        if ep > 1 and not self.model.entry and (not experts or experts % ep):
            return "parallel.ep", f"a divisor of model.moe_experts={experts} (each rank holds moe_experts/ep experts)"
        if ep > 1 and self.parallel.zero:
            return "parallel.ep", f"1 under parallel.zero={self.parallel.zero} (ZeRO does not shard expert groups)"
        return None

    @property
    def run_path(self) -> Path:
        """Per-job directory, so jobs sharing a run_dir never clobber each other."""
        return Path(self.job.run_dir) / self.job.name

    @property
    def checkpoint_path(self) -> Path:
        """Where checkpoints go; resolved here so every launcher agrees on the default."""
        return (
            Path(self.checkpoint.dir)
            if self.checkpoint.dir
            else self.run_path / CHECKPOINTS_DIR
        )


@dataclass(frozen=True)
class SweepConfig:
    """The ``[sweep]`` table of a sweep file; the values searched are its ``[params]`` (see slurm/sweep.py)."""

    base: str = _field("", "the job spec every config starts from, relative to the sweep file (required)", **_PATH)
    name: str = _field(
        "", "the sweep's name; empty: the sweep file's name",
        pattern=r"(?:[A-Za-z0-9][A-Za-z0-9._-]*)?",
        describe="empty (the sweep file's name) or letters, digits, '.', '_' or '-'", max_len=128,
    )
    method: Literal["grid", "random", "zip"] = _field(
        "grid", "grid: every combination; zip: the i-th value of each; random: samples draws")
    samples: int = _field(8, f"random: configs drawn; a sweep has at most {MAX_SWEEP_CONFIGS} configs", min=1,
                          max=MAX_SWEEP_CONFIGS)
    seed: int = _field(0, "random: the draws' seed", min=0)
    metric: str = _field(
        "final_loss", "the key of each task's result.json that ranks the tasks",
        pattern=r"[A-Za-z_][A-Za-z0-9_]*", describe="a key of the tasks' result.json"
    )
    goal: Literal["min", "max"] = _field("min", "whether the best task has the smallest or the largest metric")
    max_concurrent: int = _field(4, "Slurm array tasks running at once (%k)", min=1)
    dir: str = _field("", "the sweep directory; empty: <job.run_dir of the base spec>/<name>", **_PATH)


def spec_reference(markdown: bool = False) -> str:
    """Every setting of a job spec and a sweep file: key, type, default and meaning, from the declarations above."""
    out = ["# Job spec reference", "", "Generated by `hpc spec --markdown` from hpc/config.py, where each setting is "
           "declared. Any key can be set with `--set section.key=value`.", ""] if markdown else []
    for name, section in [*get_type_hints(JobSpec).items(), ("sweep", SweepConfig)]:
        hints = get_type_hints(section)
        rows = [(f"{name}.{f.name}", _describe(hints[f.name]), _default_text(f), f.metadata["doc"])
                for f in dataclasses.fields(section)]
        if markdown:
            out += [f"## [{name}]", "", section.__doc__.strip(), "", "| key | type | default | meaning |",
                    "|---|---|---|---|", *(f"| `{key}` | {kind} | `{default}` | {doc} |"
                                          for key, kind, default, doc in rows), ""]
        else:
            width = max(len(key) + len(default) for key, _, default, _ in rows) + 5
            lines = (f"  {key} = {default}".ljust(width) + f"  {doc} ({kind})" for key, kind, default, doc in rows)
            out += [f"[{name}] {section.__doc__.strip()}", *lines, ""]
    return "\n".join(out)


def _default_text(f: dataclasses.Field) -> str:
    value = _plain(f.default_factory() if f.default is dataclasses.MISSING else f.default)
    return str(value).lower() if isinstance(value, bool) else json.dumps(value)


class _Invalid(Exception):
    """A bad value at ``path``; the caller decides whether the file or an override is to blame."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path


def load_spec(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> JobSpec:
    """Read a TOML job spec; every error names the file (or the override) it came from."""
    return spec_from_dict(read_toml(path), show_path(path), overrides)


def read_toml(path: str | os.PathLike[str], what: str = "job spec") -> dict[str, Any]:
    """Parse a TOML file (a job spec, a sweep); every error names the file.

    Only a regular file of at most MAX_FILE_BYTES, nested at most MAX_DEPTH deep, is read:
    /dev/zero would fill the memory, a FIFO block forever, deep brackets overflow tomllib's stack.
    """
    source = show_path(path)
    try:
        text = _read_regular(path, source, what).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{source}: invalid TOML: not UTF-8 at byte {exc.start}"
        ) from None
    line = _too_deep_line(text)
    if line is not None:
        raise ConfigError(f"{source}: line {line}: arrays and inline tables nested more than {MAX_DEPTH} deep")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    deep = _too_deep_path(data)
    if deep is not None:
        raise ConfigError(f"{source}: {show_text(deep, 200)}: tables and arrays nested more than {MAX_DEPTH} deep")
    return data


def _read_regular(path: str | os.PathLike[str], source: str, what: str) -> bytes:
    """The bytes of a regular file of at most MAX_FILE_BYTES; checked before opening (a device), once open (a file
    swapped meanwhile: O_NONBLOCK keeps a FIFO from blocking the open) and while reading (a file still growing)."""
    try:
        _check_regular(os.stat(path), source, what)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
        with os.fdopen(fd, "rb") as file:
            _check_regular(os.fstat(file.fileno()), source, what)
            data = file.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"no such {what}: {source}") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read {what}: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{source}: a {what} holds at most {MAX_FILE_BYTES} bytes (1 MiB); this one is larger")
    return data


def _check_regular(info: os.stat_result, source: str, what: str) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{source}: not a regular file: a {what} must be a TOML file, not a directory, "
                          "device or pipe")
    if info.st_size > MAX_FILE_BYTES:
        raise ConfigError(f"{source}: a {what} holds at most {MAX_FILE_BYTES} bytes (1 MiB), got {info.st_size}")


def _too_deep_line(text: str) -> int | None:
    """The line where arrays and inline tables nest more than MAX_DEPTH deep, found before tomllib recurses into
    them (brackets inside strings and comments do not count)."""
    depth = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > MAX_DEPTH:
                return text.count("\n", 0, match.start()) + 1
        elif token in ("]", "}"):
            depth = max(depth - 1, 0)
    return None


def _too_deep_path(data: Any, depth: int = 0, path: str = "") -> str | None:
    """The first dotted path below ``path`` more than MAX_DEPTH tables and arrays deep (dotted keys and
    [a.b.c] headers nest without brackets); iterative, so any depth is safe."""
    stack = [(data, path, depth)]
    while stack:
        value, where, level = stack.pop()
        if level > MAX_DEPTH:
            return where
        if isinstance(value, Mapping):
            stack.extend((item, f"{where}.{key}" if where else str(key), level + 1) for key, item in value.items())
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]", level + 1) for i, item in enumerate(value))
    return None


def show_value(value: Any, limit: int = ECHO_LIMIT) -> str:
    """``repr(value)`` cut to ``limit`` characters: one short line, whatever the value."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def show_text(text: str, limit: int = ECHO_LIMIT) -> str:
    """Text as typed when it is printable and short (a path, an override), else as :func:`show_value`."""
    return text if text.isprintable() and len(text) <= limit else show_value(text, limit)


def show_path(path: str | os.PathLike[str]) -> str:
    """A file as errors name it: as typed unless it holds control characters or is over 1024 characters."""
    return show_text(os.fspath(path), 1024)


# The built-in entries' names before jobs/ became data/, models/, train/ and bench/: specs keep them.
MOVED_ENTRIES = {
    "jobs.hf:causal_lm": "jobs.models.hf:causal_lm",
    "jobs.gpt:gpt": "jobs.models.gpt:gpt",
    "jobs.models:mlp": "jobs.models.mlp:mlp",
    "jobs.tokens:tokens": "jobs.data.tokens:tokens",
    "jobs.datasets:digits": "jobs.data.datasets:digits",
    "jobs.datasets:licenses": "jobs.data.datasets:licenses",
}


def spec_from_dict(
    data: Mapping[str, Any], source: str = "<spec>", overrides: Sequence[str] = ()
) -> JobSpec:
    """Build and validate a spec from parsed TOML, after applying ``key=value`` overrides."""
    merged = apply_overrides(data, overrides)
    for section in ("model", "data"):  # a spec (or a checkpoint's) written before jobs/ was split
        table = merged.get(section)
        if isinstance(table, dict) and isinstance(table.get("entry"), str):
            table["entry"] = MOVED_ENTRIES.get(table["entry"], table["entry"])
    try:
        spec = _build(JobSpec, merged, "")
    except _Invalid as err:
        raise ConfigError(f"{_blame(err.path, source, overrides)}: {err}") from None
    return spec


def table_from_dict(cls: type, data: Mapping[str, Any], path: str, source: str) -> Any:
    """One table of another TOML file (a sweep's ``[sweep]``), with the job spec's checks and messages."""
    try:
        return _build(cls, data, path)
    except _Invalid as err:
        raise ConfigError(f"{source}: {err}") from None


def apply_overrides(
    data: Mapping[str, Any], overrides: Sequence[str]
) -> dict[str, Any]:
    """Merge ``--set dotted.key=value`` strings into a copy of ``data``.

    Values are TOML so numbers and lists keep their type; anything that is not
    valid TOML, or that lands on a string setting, stays the raw text so that
    ``job.name=foo`` and ``slurm.time=02:00:00`` need no shell-quoted quotes.
    A table value on a section (``train={lr=1}``) is refused rather than replacing the whole
    section: each key of a section is set on its own (``train.lr=1``).
    """
    result = _plain(data)
    for override in overrides:
        key, sep, text = override.partition("=")
        keys = key.strip().split(".")
        shown = show_text(override)
        if not sep or not all(keys):
            raise ConfigError(
                f"--set {shown}: expected dotted.key=value, e.g. train.lr=0.01"
            )
        value = _parse_override_value(keys, text, shown)
        table = result
        for depth, part in enumerate(keys[:-1], start=1):
            node = table.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    f"--set {shown}: {show_text('.'.join(keys[:depth]))} is not a table, got {show_value(node)}"
                )
            table = node
        table[keys[-1]] = value
    return result


def spec_to_dict(spec: JobSpec) -> dict[str, Any]:
    """TOML-compatible form, for storing a spec in checkpoints and sweeps."""
    return _plain(spec)


def _plain(value: Any) -> Any:
    """Deep copy into dicts and lists, the only containers TOML writers understand."""
    if dataclasses.is_dataclass(value):
        return {
            f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)
        }
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _parse_override_value(keys: list[str], text: str, shown: str) -> Any:
    if len(keys) > MAX_DEPTH or _too_deep_line(text) is not None:
        raise ConfigError(f"--set {shown}: tables and arrays nested more than {MAX_DEPTH} deep")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    deep = _too_deep_path(value, len(keys), ".".join(keys))
    if deep is not None:
        raise ConfigError(f"--set {shown}: {show_text(deep, 200)}: tables and arrays nested more than {MAX_DEPTH} deep")
    hint = _hint_at(keys)
    if hint is str and not isinstance(value, str):
        return text
    if isinstance(value, dict) and dataclasses.is_dataclass(hint):
        example = next(iter(value), None) or dataclasses.fields(hint)[0].name
        raise ConfigError(f"--set {shown}: {keys[0]} is a section: --set replaces one value, not a whole section; "
                          f"set its keys one at a time, e.g. --set {keys[0]}.{show_text(example, 20)}=...")
    return value


def _hint_at(keys: list[str]) -> Any:
    """Schema type at a dotted path, or None when the path is not in the schema."""
    hint: Any = JobSpec
    for key in keys:
        if not dataclasses.is_dataclass(hint):
            return None
        hint = get_type_hints(hint).get(key)
    return hint


def _blame(path: str, source: str, overrides: Sequence[str]) -> str:
    """The last override touching ``path`` if any, since that is what set it; else the file."""
    for override in reversed(overrides):
        key = override.partition("=")[0].strip()
        if _on_path(path, key) or _on_path(key, path):
            return f"--set {show_text(override)}"
    return source


def _on_path(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith((prefix + ".", prefix + "["))


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, Mapping):
        raise _Invalid(path, f"{path or 'the job spec'} must be a table, got {show_value(data)}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in data.items():
        child = f"{path}.{key}" if path else str(key)
        if key not in fields:
            renamed = getattr(cls, "renamed_keys", {}).get(key)
            if renamed is not None:
                new = f"{path}.{renamed}" if path else renamed
                raise _Invalid(child, f"{child} was renamed to {new}")
            raise _Invalid(child, _unknown_key(child, str(key), path, list(fields)))
        values[key] = _convert(hints[key], value, child, fields[key].metadata)
    built = cls(**values)
    conflict = built.field_conflict() if hasattr(built, "field_conflict") else None
    if conflict:
        name, wanted = conflict
        child = f"{path}.{name}" if path else name
        raise _Invalid(child, f"{child} must be {wanted}, got {show_value(operator.attrgetter(name)(built))}")
    return built


def _unknown_key(child: str, key: str, path: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f"did you mean {path + '.' if path else ''}{close[0]}? " if close else ""
    return f"unknown key {show_text(child)} ({hint}valid keys: {', '.join(valid)})"


def _convert(hint: Any, value: Any, path: str, constraints: Mapping[str, Any]) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    origin, args = get_origin(hint), get_args(hint)
    if origin is Mapping:
        return _table(args[1], value, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _Invalid(path, _must_be(path, hint, value))
        item_hint, ellipsis = args
        if ellipsis is not Ellipsis:
            raise TypeError(f"unsupported type in job spec schema: {hint!r}")
        return tuple(
            _convert(item_hint, item, f"{path}[{i}]", constraints)
            for i, item in enumerate(value)
        )
    for arm in args if origin in _UNIONS else (hint,):
        matched, converted = _match(arm, value)
        if matched:
            _check(converted, path, constraints)
            return converted
    raise _Invalid(path, _must_be(path, hint, value))


def _table(value_hint: Any, value: Any, path: str) -> Mapping[str, Any]:
    """A free-form table (an entry's arguments, a TP plan), read-only; ``value_hint`` is str or Any."""
    if not isinstance(value, Mapping):
        raise _Invalid(path, f"{path} must be a table, got {show_value(value)}")
    for key, item in value.items():
        if value_hint is str:
            _convert(str, item, f"{path}.{key}", {})
    return types.MappingProxyType(_plain(value))


def _match(hint: Any, value: Any) -> tuple[bool, Any]:
    """Strict TOML-to-Python typing: bools are not ints, ints are fine as floats."""
    if get_origin(hint) is Literal:
        return any(value == c and type(value) is type(c) for c in get_args(hint)), value
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint in (bool, str):
        return isinstance(value, hint), value
    raise TypeError(f"unsupported type in job spec schema: {hint!r}")


def _check(value: Any, path: str, constraints: Mapping[str, Any]) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise _Invalid(path, f"{path} must be finite, got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for name, holds, symbol in _BOUNDS:
            if name in constraints and not holds(value, constraints[name]):
                raise _Invalid(
                    path, f"{path} must be {symbol} {constraints[name]}, got {show_value(value)}"
                )
    if isinstance(value, str):
        _check_text(value, path, constraints)


def _check_text(value: str, path: str, constraints: Mapping[str, Any]) -> None:
    """Every string setting: no control characters (they would land in paths and the sbatch script), a length
    cap, then its own constraints."""
    limit = constraints.get("max_len", MAX_STRING)
    if len(value) > limit:
        raise _Invalid(path, f"{path} must be at most {limit} characters, got {len(value)}: {show_value(value)}")
    if _CONTROL.search(value):
        raise _Invalid(path, f"{path} must not contain control characters (NUL, newline, tab, ...), "
                             f"got {show_value(value)}")
    part_limit = constraints.get("max_part_bytes")
    if part_limit is not None and any(len(part.encode()) > part_limit for part in value.split("/")):
        raise _Invalid(path, f"{path} must have at most {part_limit} bytes between slashes (a file name), "
                             f"got {show_value(value)}")
    if constraints.get("shell_words"):
        try:
            shlex.split(value)
        except ValueError as exc:
            raise _Invalid(path, f"{path} must split into shell words ({exc}), got {show_value(value)}") from None
    pattern = constraints.get("pattern")
    if pattern is not None and not re.fullmatch(pattern, value):
        wanted = constraints.get("describe", f"a string matching {pattern}")
        raise _Invalid(path, f"{path} must be {wanted}, got {show_value(value)}")


def _must_be(path: str, hint: Any, value: Any) -> str:
    wanted = _describe(hint)
    # A list of choices already uses commas; a semicolon keeps the bad value apart from it.
    sep = ";" if ", " in wanted else ","
    return f"{path} must be {wanted}{sep} got {show_value(value)}"


def _describe(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return (
            repr(args[0]) if len(args) == 1 else f"one of {', '.join(map(str, args))}"
        )
    if origin in _UNIONS:
        return " or ".join(_describe(arm) for arm in args)
    if origin is tuple:
        return f"a list of {_NOUNS[args[0]]}s"
    if origin is Mapping:
        return "a table" if args[1] is Any else f"a table of {_NOUNS[args[1]]}s"
    noun = _NOUNS[hint]
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"

