"""Job spec loading: defaults, round-trips, one-line errors and --set overrides."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import get_type_hints

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc.config import (
    MOVED_ENTRIES,
    JobSpec,
    SweepConfig,
    apply_overrides,
    load_spec,
    spec_from_dict,
    spec_reference,
    spec_to_dict,
)
from hpc.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[1] / "jobs" / "examples" / "mlp.toml"

FULL = {
    "job": {"name": "mlp-digits.v2", "seed": 7, "run_dir": "/scratch/runs"},
    "model": {
        "entry": "mynet.models:build",
        "args": {"width": 512, "layers": [2, 2], "norm": {"eps": 1e-6}},
        "tp_plan": {"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"},
        "kind": "gpt",
        "hidden_sizes": [256, 256, 128],
        "dropout": 0.1,
        "n_layers": 6,
        "n_heads": 8,
        "d_model": 256,
        "seq_len": 128,
        "moe_experts": 0,
        "moe_top_k": 2,
        "moe_every": 2,
        "moe_capacity_factor": 1.5,
        "moe_aux_loss_coef": 0.02,
        "moe_z_loss_coef": 0.001,
    },
    "data": {"entry": "mynet.data:windows", "args": {"path": "/scratch/text"}, "name": "digits", "batch_size": 32},
    "train": {
        "steps": 2000,
        "lr": 3e-4,
        "optimizer": "adamw",
        "momentum": 0.5,
        "trust_coefficient": 0.02,
        "weight_decay": 0.01,
        "grad_clip": 1.0,
        "freeze": ["embedding.*", "blocks.[01].*"],
        "warmup_steps": 100,
        "lr_schedule": "cosine",
        "log_every": 50,
        "lr_reference_batch": 256,
        "bf16_autocast": True,
        "activation_checkpointing": True,
        "recompute": "selective",
        "float8": "rowwise",
        "fused_head_loss": True,
        "compile": True,
        "timeline": True,
        "profile_steps": 5,
        "stall_warn_s": 5.0,
        "stall_abort_s": 20.0,
        "health_check": True,
        "health_check_timeout_s": 10.0,
        "health_cluster": "h100-dgx",
        "straggler_every": 20,
        "straggler_threshold": 1.5,
    },
    "parallel": {
        "dp": 2,
        "tp": 2,
        "pp": 2,
        "ep": 1,
        "microbatches": 8,
        "schedule": "interleaved",
        "virtual_stages": 2,
        "backend": "nccl",
        "device": "cuda",
        "compression": "int8",
        "topk_fraction": 0.05,
        "powersgd_rank": 2,
        "compression_warmup_steps": 10,
        "compression_scope": "inter-node",
        "transport": "mpi",
        "bucket_mb": 4.0,
        "overlap": False,
        "zero": 1,
        "init_timeout_s": 120.0,
        "timeout_s": 600.0,
    },
    "checkpoint": {
        "dir": "/scratch/ckpt",
        "every_steps": 500,
        "keep": 2,
        "local_every_steps": 5,
        "local_keep": 3,
        "local_dir": "/local/scratch",
        "async_save": True,
        "resume": "/scratch/ckpt/step-500",
        "init_from": "",
    },
    "slurm": {
        "nodes": 2,
        "ntasks_per_node": 4,
        "gpus_per_node": 4,
        "gpus_per_task": 1,
        "cpus_per_task": 8,
        "mem": "64G",
        "partition": "gpu",
        "time": "1-12:00:00",
        "account": "proj42",
        "qos": "high",
        "constraint": "a100&nvlink",
        "setup": ["module load cuda", "source venv/bin/activate"],
        "signal_delay_s": 300,
        "max_requeues": 5,
        "max_restarts": 2,
        "spare_nodes": 1,
        "elastic": True,
    },
}


def error_of(toml_text: str, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        spec_from_dict(tomllib.loads(toml_text), source="job.toml", overrides=overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text("")
    spec = load_spec(path)
    assert spec == JobSpec()
    assert spec.model.hidden_sizes == (128, 128)
    assert spec.parallel.dp == "auto"
    assert spec.train.lr == 0.1
    assert spec.run_path == Path("runs/job")
    assert spec.checkpoint_path == Path("runs/job/checkpoints")


def test_example_spec_loads() -> None:
    spec = load_spec(EXAMPLE)
    assert spec.job.name == "mlp-digits"
    assert spec.model.kind == "mlp"
    assert spec.model.hidden_sizes == (128, 64)
    assert (spec.data.name, spec.data.batch_size) == ("digits", 128)
    assert (spec.train.steps, spec.train.lr, spec.train.optimizer) == (300, 0.1, "sgd")
    assert (spec.train.momentum, spec.train.log_every) == (0.9, 20)
    assert spec.parallel.dp == "auto"
    assert spec.run_path == Path("runs/mlp-digits")


def test_full_spec_round_trips() -> None:
    spec = spec_from_dict(FULL)
    assert spec.model.hidden_sizes == (256, 256, 128)
    assert spec.slurm.setup == ("module load cuda", "source venv/bin/activate")
    assert spec.checkpoint_path == Path("/scratch/ckpt")
    plain = spec_to_dict(spec)
    assert plain == FULL
    assert isinstance(plain["model"]["hidden_sizes"], list)
    assert spec_from_dict(plain) == spec


def test_int_is_accepted_for_a_float() -> None:
    spec = spec_from_dict({"train": {"lr": 1}})
    assert spec.train.lr == 1.0 and isinstance(spec.train.lr, float)


@pytest.mark.parametrize(
    ("toml_text", "expected"),
    [
        ("[train]\nlr = -1.0", "job.toml: train.lr must be > 0, got -1.0"),
        (
            "[train]\nsteps = 'ten'",
            "job.toml: train.steps must be an integer, got 'ten'",
        ),
        ("[train]\nsteps = true", "job.toml: train.steps must be an integer, got True"),
        ("[train]\nsteps = 10.0", "job.toml: train.steps must be an integer, got 10.0"),
        ("[train]\nlr = true", "job.toml: train.lr must be a number, got True"),
        ("[train]\nlr = inf", "job.toml: train.lr must be finite, got inf"),
        ("[train]\nsteps = 0", "job.toml: train.steps must be >= 1, got 0"),
        ("[model]\ndropout = 1.0", "job.toml: model.dropout must be < 1, got 1.0"),
        (
            "[model]\nhidden_sizes = [128, 0]",
            "job.toml: model.hidden_sizes[1] must be >= 1, got 0",
        ),
        (
            "[model]\nhidden_sizes = 128",
            "job.toml: model.hidden_sizes must be a list of integers, got 128",
        ),
        (
            "[parallel]\nbackend = 'mpi'",
            (
                "job.toml: parallel.backend must be one of auto, gloo, nccl; got 'mpi'"
            ),
        ),
        (
            "[parallel]\ndp = 'x'",
            "job.toml: parallel.dp must be an integer or 'auto', got 'x'",
        ),
        ("[parallel]\ndp = 0", "job.toml: parallel.dp must be >= 1, got 0"),
        (
            "[checkpoint]\nasync_save = 1",
            "job.toml: checkpoint.async_save must be a boolean, got 1",
        ),
        ("train = 3", "job.toml: train must be a table, got 3"),
        ("[model]\nn_heads = 3", "job.toml: model.d_model must be divisible by n_heads=3, got 128"),
        (
            "[train]\nstall_warn_s = 300",
            "job.toml: train.stall_abort_s must be greater than stall_warn_s=300, got 240.0",
        ),
        (
            "[train]\nrecompute = 'selective'",
            "job.toml: train.recompute must be 'full' without train.activation_checkpointing = true (it chooses what "
            "the checkpointed blocks recompute), got 'selective'",
        ),
        ("[data]\nname = 'text'", "job.toml: data.name must be one of digits, licenses; got 'text'"),
    ],
)
def test_bad_value_errors(toml_text: str, expected: str) -> None:
    assert error_of(toml_text) == expected


@pytest.mark.parametrize(
    ("toml_text", "fragments"),
    [
        ("[job]\nname = 'my job'", ["job.toml: job.name must be", "got 'my job'"]),
        (
            "[slurm]\ntime = '1h'",
            ["slurm.time must be a Slurm time limit", "HH:MM:SS", "got '1h'"],
        ),
        ("[slurm]\nmem = '16GB'", ["slurm.mem must be", "16G", "got '16GB'"]),
        (
            "[slurm]\npartition = 'gpu debug'",
            ["slurm.partition must be", "got 'gpu debug'"],
        ),
        ("[slurm]\nsetup = ['ok', 3]", ["slurm.setup[1] must be a string, got 3"]),
    ],
)
def test_pattern_errors_explain_the_format(
    toml_text: str, fragments: list[str]
) -> None:
    message = error_of(toml_text)
    for fragment in fragments:
        assert fragment in message


def test_slurm_time_formats() -> None:
    for time in ["30", "30:00", "12:00:00", "2-0", "2-12", "2-12:30", "2-12:30:00"]:
        assert spec_from_dict({"slurm": {"time": time}}).slurm.time == time


def test_unknown_key_suggests_the_closest() -> None:
    assert error_of("[train]\nlrr = 0.1") == (
        "job.toml: unknown key train.lrr (did you mean train.lr? valid keys: steps, lr, "
        "optimizer, momentum, trust_coefficient, weight_decay, grad_clip, freeze, warmup_steps, lr_schedule, "
        "log_every, "
        "lr_reference_batch, "
        "bf16_autocast, activation_checkpointing, recompute, float8, fused_head_loss, compile, timeline, "
        "profile_steps, stall_warn_s, stall_abort_s, health_check, "
        "health_check_timeout_s, health_cluster, straggler_every, straggler_threshold)"
    )


def test_unknown_section_lists_the_sections() -> None:
    message = error_of("[trian]\nlr = 0.1")
    assert message.startswith(
        "job.toml: unknown key trian (did you mean train? valid keys: job,"
    )


def test_unknown_key_without_a_close_match() -> None:
    message = error_of("[slurm]\nzzz = 1")
    assert message.startswith("job.toml: unknown key slurm.zzz (valid keys: nodes,")


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text("[train\nlr = 1")
    with pytest.raises(ConfigError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}: invalid TOML: ")
    assert "\n" not in str(info.value)


def test_load_errors_are_prefixed_by_the_file(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text("[train]\nlr = -1.0\n")
    with pytest.raises(ConfigError, match="must be > 0") as info:
        load_spec(path)
    assert str(info.value) == f"{path}: train.lr must be > 0, got -1.0"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_spec(path)
    assert str(info.value) == f"no such job spec: {path}"


def test_override_types() -> None:
    spec = spec_from_dict(
        {},
        overrides=[
            "train.lr=3e-4",
            "model.hidden_sizes=[64,64]",
            "job.name=foo",
            "parallel.dp=auto",
            "parallel.tp=2",
            "checkpoint.async_save=true",
        ],
    )
    assert spec.train.lr == 3e-4
    assert spec.model.hidden_sizes == (64, 64)
    assert spec.job.name == "foo"
    assert spec.parallel.dp == "auto"
    assert spec.parallel.tp == 2
    assert spec.checkpoint.async_save is True


def test_override_on_a_string_setting_keeps_the_raw_text() -> None:
    """TOML would read these as a time and an integer; the schema says string."""
    spec = spec_from_dict({}, overrides=["slurm.time=02:00:00", "job.name=123"])
    assert spec.slurm.time == "02:00:00"
    assert spec.job.name == "123"


def test_override_beats_the_file_and_the_last_one_wins(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text("[train]\nsteps = 10\n")
    spec = load_spec(path, overrides=["train.steps=20", "train.steps=30"])
    assert spec.train.steps == 30


def test_override_errors_name_the_override() -> None:
    assert (
        error_of("", ("train.lr=abc",))
        == "--set train.lr=abc: train.lr must be a number, got 'abc'"
    )
    assert error_of("", ("train.lrr=1",)).startswith(
        "--set train.lrr=1: unknown key train.lrr (did you mean train.lr?"
    )
    assert error_of("", ("trian.lr=1",)).startswith(
        "--set trian.lr=1: unknown key trian ("
    )
    assert error_of("", ("model.hidden_sizes=[8,0]",)) == (
        "--set model.hidden_sizes=[8,0]: model.hidden_sizes[1] must be >= 1, got 0"
    )


def test_file_errors_are_not_blamed_on_unrelated_overrides() -> None:
    message = error_of("[train]\nlr = -1.0", ("train.steps=5",))
    assert message == "job.toml: train.lr must be > 0, got -1.0"


@pytest.mark.parametrize("override", ["train.lr", "=3", "train..lr=3", ".lr=3"])
def test_malformed_override(override: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides({}, [override])
    assert str(info.value).startswith(f"--set {override}: expected dotted.key=value")


def test_override_into_a_scalar() -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides({"train": {"lr": 0.1}}, ["train.lr.x=1"])
    assert str(info.value) == "--set train.lr.x=1: train.lr is not a table, got 0.1"


def test_apply_overrides_does_not_mutate_its_input() -> None:
    data = {"train": {"lr": 0.1}, "model": {"hidden_sizes": [8]}}
    result = apply_overrides(data, ["train.lr=0.2", "data.name=cifar"])
    assert data == {"train": {"lr": 0.1}, "model": {"hidden_sizes": [8]}}
    assert result == {
        "train": {"lr": 0.2},
        "model": {"hidden_sizes": [8]},
        "data": {"name": "cifar"},
    }
    result["model"]["hidden_sizes"].append(9)
    assert data["model"]["hidden_sizes"] == [8]


def test_schema_uses_only_known_constraints() -> None:
    """A misspelt constraint would be silently ignored by the builder."""
    known = {"doc", "min", "gt", "max_excl", "max", "pattern", "describe", "max_len", "max_part_bytes", "shell_words"}
    for name, section in [*get_type_hints(JobSpec).items(), ("sweep", SweepConfig)]:
        for f in dataclasses.fields(section):
            assert set(f.metadata) <= known, f"{name}.{f.name}"


def test_every_setting_is_documented_where_declared() -> None:
    """hpc spec and docs/JOB_SPEC.md print these texts: a setting without one would be a blank row."""
    for name, section in [*get_type_hints(JobSpec).items(), ("sweep", SweepConfig)]:
        assert section.__doc__ and not section.__doc__.startswith(section.__name__ + "("), name
        for f in dataclasses.fields(section):
            assert f.metadata.get("doc", "").strip(), f"{name}.{f.name} has no doc"


def test_job_spec_reference_is_current() -> None:
    """docs/JOB_SPEC.md is what ``hpc spec --markdown`` prints: regenerate it when a setting changes."""
    doc = Path(__file__).resolve().parents[1] / "docs" / "JOB_SPEC.md"
    assert doc.read_text() == spec_reference(markdown=True), "run: hpc spec --markdown > docs/JOB_SPEC.md"


def test_renamed_key_names_its_new_name(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('[train]\nschedule = "cosine"\n')
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    assert str(err.value) == f"{path}: train.schedule was renamed to train.lr_schedule"
    with pytest.raises(ConfigError, match=r"^--set train.schedule=cosine: train.schedule was renamed to "
                                          r"train.lr_schedule$"):
        load_spec(EXAMPLE, ["train.schedule=cosine"])


finite = {"allow_nan": False, "allow_infinity": False}


@given(
    steps=st.integers(min_value=1, max_value=2**62),
    lr=st.floats(min_value=0, exclude_min=True, **finite),
    dropout=st.floats(min_value=0, max_value=1, exclude_max=True, **finite),
    momentum=st.floats(min_value=0, max_value=1, exclude_max=True, **finite),
    dp=st.one_of(st.just("auto"), st.integers(min_value=1, max_value=4096)),
    timeout_s=st.floats(min_value=0, exclude_min=True, **finite),
    seed=st.integers(min_value=0, max_value=2**63 - 1),
)
def test_round_trip_property(steps, lr, dropout, momentum, dp, timeout_s, seed) -> None:
    data = {
        "job": {"seed": seed},
        "model": {"dropout": dropout},
        "train": {"steps": steps, "lr": lr, "momentum": momentum},
        "parallel": {"dp": dp, "timeout_s": timeout_s},
    }
    spec = spec_from_dict(data)
    assert spec_from_dict(spec_to_dict(spec)) == spec
    assert (spec.train.lr, spec.parallel.dp, spec.job.seed) == (lr, dp, seed)


@given(
    lr=st.floats(min_value=0, exclude_min=True, **finite),
    steps=st.integers(min_value=1, max_value=2**63 - 1),
)
def test_override_round_trip_property(lr: float, steps: int) -> None:
    """What Python prints is what --set reads back, exactly."""
    spec = spec_from_dict({}, overrides=[f"train.lr={lr!r}", f"train.steps={steps}"])
    assert (spec.train.lr, spec.train.steps) == (lr, steps)


# --- input limits (issue 16): every bad input is one line naming the file or the override ---------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("v = " + "[" * 3000 + "]" * 3000, "line 1: arrays and inline tables nested more than 32 deep"),
        ("[train]\nlr = " + "{a=" * 3000 + "1" + "}" * 3000, "line 2: arrays and inline tables nested more than 32"),
        (".".join(["a"] * 3000) + " = 1", ".".join(["a"] * 33) + ": tables and arrays nested more than 32 deep"),
        ("[" + ".".join(["a"] * 3000) + "]", "nested more than 32 deep"),
        ("[model]\nhidden_sizes = " + "[" * 40 + "]" * 40, "line 2: arrays and inline tables nested more than 32"),
        ("[model]\nhidden_sizes = " + "[" * 32 + "]" * 32,  # 32 brackets, but 34 levels with [model] and the key
         "job.toml: model.hidden_sizes" + "[0]" * 31 + ": tables and arrays nested"),
    ],
)
def test_nesting_deeper_than_the_limit_is_one_line_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}: ") and message in str(info.value)
    assert "\n" not in str(info.value)


def test_brackets_in_strings_and_comments_do_not_count_as_nesting(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    brackets = "[" * 100
    path.write_text(f'[job] # {brackets}\nrun_dir = "{brackets}"\n[checkpoint]\nresume = \'{brackets}\'\n'
                    f'[slurm]\nsetup = ["""{brackets}\\"\\"""", \'\'\'{brackets}\'\'\']\n')
    spec = load_spec(path)
    assert spec.job.run_dir == spec.checkpoint.resume == brackets and spec.slurm.setup == (brackets + '""', brackets)


@pytest.mark.parametrize("override", ["train.lr=" + "[" * 3000, "train.lr=" + "[" * 40 + "]" * 40,
                                      ".".join(["a"] * 3000) + "=1",
                                      "model.hidden_sizes=" + "{a=" * 40 + "1" + "}" * 40],
                         ids=["unclosed-array", "array", "dotted-key", "inline-table"])
def test_deep_overrides_are_one_line_naming_the_override(override: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_spec(EXAMPLE, [override])
    message = str(info.value)
    assert message.startswith("--set ") and override[:12] in message and "nested more than 32 deep" in message
    assert "\n" not in message and len(message) < 250


def test_devices_pipes_directories_and_large_files_are_refused_before_reading(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    big = tmp_path / "big.toml"
    big.write_text("# padding\n" * 110_000)
    for path, reason in [("/dev/zero", "not a regular file"), (fifo, "not a regular file"),
                         (tmp_path, "not a regular file"),
                         (big, "a job spec holds at most 1048576 bytes (1 MiB), got 1100000")]:
        with pytest.raises(ConfigError) as info:
            load_spec(path)
        assert str(info.value).startswith(f"{path}: {reason}")


@pytest.mark.parametrize(
    ("toml_text", "overrides", "expected"),
    [
        ('[job]\nrun_dir = "runs\\u0000x"', (), "job.toml: job.run_dir must not contain control characters"),
        ('[checkpoint]\ndir = "/ckpt\\nx"', (), "job.toml: checkpoint.dir must not contain control characters"),
        ('[slurm]\nsetup = ["module load\\u0000x"]', (), "job.toml: slurm.setup[0] must not contain control"),
        ("", ("job.run_dir=a\x00b",), "--set 'job.run_dir=a\\x00b': job.run_dir must not contain control characters"),
        ("", ("slurm.partition=gpu\rx",), "--set 'slurm.partition=gpu\\rx': slurm.partition must not contain control"),
    ],
)
def test_control_characters_in_string_settings_are_refused(toml_text: str, overrides, expected: str) -> None:
    assert error_of(toml_text, overrides).startswith(expected)


def test_a_seed_is_one_torch_can_take() -> None:
    """A seed of 2**64 passed the spec and failed every rank inside torch.manual_seed."""
    too_large = error_of("", ("job.seed=18446744073709551616",))
    assert "job.seed must be <= 18446744073709551615, got 18446744073709551616" in too_large
    assert spec_from_dict({"job": {"seed": 2**64 - 1}}).job.seed == 2**64 - 1


def test_a_nodes_ranks_bind_no_more_gpus_than_it_asks_for() -> None:
    """Slurm would leave such a job pending (or refuse it) after hpc submit had said it was submitted."""
    assert ("slurm.gpus_per_task must be at most gpus_per_node / tasks per node = 2/2 (2 ranks a node would bind 8 "
            "GPUs of the 2 asked for), got 4") in error_of("", ("slurm.gpus_per_node=2", "slurm.gpus_per_task=4"))
    assert "slurm.gpus_per_task" in error_of("", ("slurm.gpus_per_node=8", "slurm.ntasks_per_node=4",
                                                  "slurm.gpus_per_task=4"))
    fitting = [("slurm.gpus_per_node=8", "slurm.gpus_per_task=1"), ("slurm.gpus_per_task=2",),
               ("slurm.gpus_per_node=8", "slurm.ntasks_per_node=2", "slurm.gpus_per_task=4")]
    for overrides in fitting:
        assert spec_from_dict({}, overrides=overrides).slurm.gpus_per_task in (1, 2, 4)


def test_string_settings_are_capped_in_length() -> None:
    assert error_of(f'[job]\nname = "{"a" * 129}"').startswith(
        "job.toml: job.name must be at most 128 characters, got 129: 'aaaa")
    assert spec_from_dict({"job": {"name": "a" * 128}}).job.name == "a" * 128
    assert error_of("", (f"slurm.account={'a' * 2000}",)).startswith(
        "--set 'slurm.account=aaaaa")
    assert "slurm.account must be at most 1024 characters, got 2000" in error_of("", (f"slurm.account={'a' * 2000}",))
    assert "job.run_dir must have at most 255 bytes between slashes" in error_of(f'[job]\nrun_dir = "/x/{"b" * 256}"')
    assert spec_from_dict({"job": {"run_dir": "/x/" + "b" * 255}}).job.run_dir.endswith("b" * 255)


def test_setup_lines_must_split_into_shell_words_in_the_spec_itself() -> None:
    assert error_of("[slurm]\nsetup = [\"echo 'unclosed\"]") == (
        "job.toml: slurm.setup[0] must split into shell words (No closing quotation), got \"echo 'unclosed\"")
    assert spec_from_dict({"slurm": {"setup": ["module load 'cuda 12'"]}}).slurm.setup == ("module load 'cuda 12'",)


def test_a_table_on_a_section_is_refused_not_a_silent_replacement() -> None:
    with pytest.raises(ConfigError) as info:
        load_spec(EXAMPLE, ["train={lr=1}"])
    assert str(info.value) == ("--set train={lr=1}: train is a section: --set replaces one value, not a whole "
                               "section; set its keys one at a time, e.g. --set train.lr=...")
    assert load_spec(EXAMPLE, ["train.lr=1"]).train.momentum == 0.9  # the rest of [train] stays


@pytest.mark.parametrize("override", ["train.lr=1\n2", "train.lr=" + "x" * 5000, "job.name=a\nb\nc",
                                      "trian\n.lr=1", "train.lr\n", "model.hidden_sizes=[1, \"a\nb\"]"])
def test_every_override_error_is_one_short_line(override: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_spec(EXAMPLE, [override])
    message = str(info.value)
    assert "\n" not in message and "\r" not in message and len(message) < 400, message
    assert message.startswith("--set ")


def test_a_zero_time_limit_is_refused() -> None:
    """Slurm reads 0 as no limit at all; a spec asks for a real one."""
    for zero in ("0", "00:00:00", "0-0", "0-00:00:00"):
        assert "slurm.time must be a Slurm time limit above zero" in error_of(f"[slurm]\ntime = '{zero}'")
    assert spec_from_dict({"slurm": {"time": "0-00:01"}}).slurm.time == "0-00:01"


def test_sweep_samples_are_capped() -> None:
    assert SweepConfig(samples=1000).samples == 1000
    field = {f.name: f for f in dataclasses.fields(SweepConfig)}["samples"]
    assert field.metadata["max"] == 1000


@pytest.mark.parametrize("section, old", [("model", "jobs.hf:causal_lm"), ("model", "jobs.gpt:gpt"),
                                          ("model", "jobs.models:mlp"), ("data", "jobs.tokens:tokens"),
                                          ("data", "jobs.datasets:licenses")])
def test_entries_named_before_jobs_was_split_still_load(section, old) -> None:
    """Specs and checkpoints written before jobs/ became data/, models/, train/ keep their entry names."""
    from hpc.entry import load_entry

    spec = spec_from_dict({section: {"entry": old}})
    new = getattr(spec, section).entry
    assert new == MOVED_ENTRIES[old] and new != old
    assert callable(load_entry(new, f"{section}.entry"))
