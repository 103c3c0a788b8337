"""Bad input refused before any rank starts (issue 45): one ``hpc: error:`` line naming the file, field or path,
exit 2, from ``hpc run --dry-run`` and from ``hpc submit`` (which then submits nothing), never a traceback and
never a run that trains on garbage.

A family per surface: a token set (``jobs.data.tokens:tokens``) damaged in its ``meta.json``, its files' sizes, its
offsets and its ids; a transformers directory (``model.args.pretrained``) damaged in its ``config.json`` and its
safetensors headers; ``checkpoint.init_from`` naming what is not this model's checkpoint and a device the
backend cannot run on; and the odd ones (``hpc plan --layout ''``, an entry that exits, ``hpc ckpt export --to``
under a file). Each goes through ``hpc.cli.main.main`` in-process.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hpc.cli.main import main

REPO = Path(__file__).resolve().parents[1]
GPT_TOKENS = REPO / "jobs" / "examples" / "gpt_tokens.toml"
VOCAB = 512


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _refused(argv: list[str], message: str, run_dir: Path) -> str:
    """``hpc ARGV`` is exit 2 and one ``hpc: error:`` line holding ``message``; nothing started or written."""
    code, out, err = _cli(*argv)
    assert code == 2, (code, out, err)
    assert err.startswith("hpc: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err
    assert "RANK=" not in out and not run_dir.exists(), out
    return err


@pytest.fixture
def no_slurm(monkeypatch) -> list:
    """``hpc submit`` without a cluster: what would be submitted is recorded, nothing is."""
    from slurm import submit

    submitted: list = []
    monkeypatch.setattr(submit, "check_resources", lambda *args, **kwargs: None)
    monkeypatch.setattr(submit, "make_executor", lambda *args, **kwargs: object())
    monkeypatch.setattr(submit, "submit", lambda *args: submitted.append(args) or "1")
    return submitted


def _run_and_submit(spec: Path, overrides: list[str], message: str, run_dir: Path, submitted: list) -> None:
    sets = [x for override in overrides for x in ("--set", override)]
    _refused(["run", "--dry-run", "--launcher", "local", str(spec), *sets], message, run_dir)
    _refused(["submit", str(spec), *sets], message, run_dir)
    assert submitted == []


# --- token sets ---------------------------------------------------------------------------------------------


def write_set(directory: Path, docs: list[list[int]], vocab: int = VOCAB, dtype: str = "uint16") -> Path:
    """A token set as hpc data prepare writes it, by hand: each document's ids and an EOS (0)."""
    directory.mkdir(parents=True)
    ids = np.concatenate([np.asarray([*doc, 0]) for doc in docs]).astype(np.dtype(dtype).newbyteorder("<"))
    offsets = np.concatenate(([0], np.cumsum([len(doc) + 1 for doc in docs]))).astype("<i8")
    (directory / "tokens.bin").write_bytes(ids.tobytes())
    (directory / "offsets.bin").write_bytes(offsets.tobytes())
    meta = {"format": "hpc-tokens", "version": 1, "documents": len(docs),
            "tokens": {"file": "tokens.bin", "dtype": dtype, "count": len(ids)},
            "offsets": {"file": "offsets.bin", "dtype": "int64", "count": len(docs) + 1},
            "tokenizer": {"source": "hand", "file": "tokenizer.json", "vocab_size": vocab, "eos": "</s>",
                          "eos_id": 0}}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def _docs() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, VOCAB, int(rng.integers(20, 60))).tolist() for _ in range(12)]


def _edit_meta(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        meta = json.loads((directory / "meta.json").read_text())
        edit(meta)
        (directory / "meta.json").write_text(json.dumps(meta))
    return apply


def _write(name: str, data: bytes | Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        file = directory / name
        file.write_bytes(data(file.read_bytes()) if callable(data) else data)
    return apply


def _offsets(edit: Callable[[np.ndarray], None]) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        offsets = np.fromfile(directory / "offsets.bin", "<i8")
        edit(offsets)
        offsets.astype("<i8").tofile(directory / "offsets.bin")
    return apply


def _id_past_vocab(directory: Path) -> None:
    ids = np.fromfile(directory / "tokens.bin", "<u2")
    ids[100] = VOCAB + 7
    ids.tofile(directory / "tokens.bin")


def _swap(a: int, b: int) -> Callable[[np.ndarray], None]:
    def apply(offsets: np.ndarray) -> None:
        offsets[a], offsets[b] = offsets[b], offsets[a]
    return apply


TOKEN_SETS = {  # case -> (what is done to a good set, what the line says)
    "no tokenizer": (_edit_meta(lambda m: m.pop("tokenizer")), "meta.json has no tokenizer.vocab_size"),
    "tokenizer null": (_edit_meta(lambda m: m.update(tokenizer=None)), "meta.json tokenizer is null, not a table"),
    "no vocab_size": (_edit_meta(lambda m: m["tokenizer"].pop("vocab_size")), "has no tokenizer.vocab_size"),
    "string vocab_size": (_edit_meta(lambda m: m["tokenizer"].update(vocab_size="512")),
                          "tokenizer.vocab_size is '512', not a positive integer"),
    "no tokens": (_edit_meta(lambda m: m.pop("tokens")), "meta.json has no tokens.count"),
    "dtype V2": (_edit_meta(lambda m: m["tokens"].update(dtype="V2")), "tokens.dtype is 'V2', not an unsigned"),
    "dtype S2": (_edit_meta(lambda m: m["tokens"].update(dtype="S2")), "tokens.dtype is 'S2', not an unsigned"),
    "dtype float16": (_edit_meta(lambda m: m["tokens"].update(dtype="float16")), "tokens.dtype is 'float16'"),
    "dtype garbage": (_edit_meta(lambda m: m["tokens"].update(dtype="garbage!")), "tokens.dtype is 'garbage!'"),
    "dtype list": (_edit_meta(lambda m: m["tokens"].update(dtype=["uint16"])), "tokens.dtype is ['uint16']"),
    "negative count": (_edit_meta(lambda m: m["tokens"].update(count=-3)), "tokens.count is -3, not a count"),
    "documents float": (_edit_meta(lambda m: m.update(documents=12.0)), "documents is 12.0, not a count"),
    "offsets count": (_edit_meta(lambda m: m["offsets"].update(count=5)), "says offsets.count=5 for 12 documents"),
    "meta a list": (_write("meta.json", b'[{"format": "hpc-tokens", "version": 1}]'),
                    "meta.json is not hpc-tokens version 1"),
    "meta not JSON": (_write("meta.json", b"{"), "meta.json is not JSON (JSONDecodeError"),
    "meta deep": (_write("meta.json", b"[" * 100_000 + b"]" * 100_000), "meta.json is not JSON (RecursionError"),
    "meta not UTF-8": (_write("meta.json", b"\xff\xfe{}"), "meta.json is not JSON"),
    "tokens odd size": (_write("tokens.bin", lambda b: b + b"\x01"),
                        "tokens.bin holds 1,041 bytes, meta.json says 520 (tokens.count) x 2 (uint16)"),
    "tokens short": (_write("tokens.bin", lambda b: b[:-2]), "tokens.bin holds 1,038 bytes"),
    "tokens gone": (lambda d: (d / "tokens.bin").unlink(), "tokens.bin is missing"),
    "tokens a directory": (lambda d: ((d / "tokens.bin").unlink(), (d / "tokens.bin").mkdir()),
                           "tokens.bin is not a file"),
    "offsets short": (_write("offsets.bin", lambda b: b[:-8]), "offsets.bin holds 96 bytes"),
    "offset past the end": (_offsets(lambda o: o.__setitem__(-1, 10**6)), "offsets.bin runs from 0 to 1,000,000"),
    "offset inside the file, past the end": (_offsets(lambda o: o.__setitem__(5, 10**6)),
                                             "offsets.bin decreases at entry 6"),
    "negative offset": (_offsets(lambda o: o.__setitem__(3, -3288)), "offsets.bin decreases at entry 3"),
    "offsets not monotonic": (_offsets(_swap(4, 5)), "offsets.bin decreases at entry 5"),
    "offsets not from 0": (_offsets(lambda o: o.__setitem__(0, 2)), "offsets.bin runs from 2 to"),
    "id past the vocabulary": (_id_past_vocab, "tokens.bin holds id 519 at token 100, past the vocabulary of 512"),
}


@pytest.fixture
def token_spec(tmp_path) -> tuple[Path, list[str]]:
    """A GPT spec on a good token set at tmp_path/set (a dry run passes) and the overrides it needs."""
    directory = write_set(tmp_path / "set", _docs())
    overrides = [f"data.args.path={directory}", f"job.run_dir={tmp_path / 'runs'}", f"model.args.vocab_size={VOCAB}",
                 "model.args.seq_len=16", "model.args.n_layers=1", "model.args.d_model=32", "data.batch_size=4",
                 "data.args.held_out=0.1"]
    return GPT_TOKENS, overrides


def test_a_good_token_set_passes_the_dry_run(token_spec, tmp_path) -> None:
    spec, overrides = token_spec
    code, out, err = _cli("run", "--dry-run", "--launcher", "local", str(spec),
                          *(x for o in overrides for x in ("--set", o)))
    assert code == 0 and "RANK=0" in out and err == "", err


@pytest.mark.parametrize("case", list(TOKEN_SETS))
def test_a_damaged_token_set_is_one_line_before_launch(token_spec, tmp_path, no_slurm, case) -> None:
    spec, overrides = token_spec
    damage, message = TOKEN_SETS[case]
    damage(tmp_path / "set")
    _run_and_submit(spec, overrides, message, tmp_path / "runs", no_slurm)
    err = _refused(["run", "--dry-run", "--launcher", "local", str(spec),
                    *(x for o in overrides for x in ("--set", o))], message, tmp_path / "runs")
    assert f"data.args.path='{tmp_path / 'set'}'" in err, err


@pytest.mark.parametrize(("override", "message"), [
    ("data.args.held_out='0.1'", "data.args.held_out='0.1' must be a number in [0, 1)"),
    ("data.args.held_out=true", "data.args.held_out=True must be a number in [0, 1)"),
    ("data.args.held_out=1.5", "data.args.held_out=1.5 must be a number in [0, 1)"),
    ("data.args.split_seed=-1", "data.args.split_seed=-1 must be an integer >= 0"),
    ("data.args.path=3", "needs data.args.path = the directory hpc data prepare wrote"),
    ("data.args.nosuch=3", "data.args do not fit jobs.data.tokens:tokens"),
    ("model.args.vocab_size=100", "more than the model's vocabulary (model.args.vocab_size) of 100"),
])
def test_bad_token_set_arguments_are_one_line_before_launch(token_spec, tmp_path, no_slurm, override,
                                                            message) -> None:
    spec, overrides = token_spec
    _run_and_submit(spec, [*overrides, override], message, tmp_path / "runs", no_slurm)


def test_the_entry_opens_a_set_checked_whole(tmp_path) -> None:
    """On a rank too (a set damaged after the pre-launch check): the entry refuses it, never an IndexError."""
    from hpc.errors import ConfigError
    from jobs.data.tokens import tokens

    directory = write_set(tmp_path / "set", _docs())
    assert len(tokens(str(directory), seq_len=8, held_out=0).train) > 0
    _id_past_vocab(directory)
    with pytest.raises(ConfigError, match=r"tokens\.bin holds id 519 at token 100"):
        tokens(str(directory), seq_len=8)
    directory = write_set(tmp_path / "neg", _docs())
    _offsets(lambda o: o.__setitem__(3, -3288))(directory)
    with pytest.raises(ConfigError, match=r"offsets\.bin decreases at entry 3"):
        tokens(str(directory), seq_len=8, held_out=0)


# --- a transformers directory (model.args.pretrained) ----------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A two-layer Llama as save_pretrained writes it: config.json and one model.safetensors."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    path = tmp_path_factory.mktemp("pretrained") / "llama"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def _config(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        replaced = edit(config)
        (directory / "config.json").write_text(replaced if isinstance(replaced, str) else json.dumps(config))
    return apply


def _header(edit: Callable[[dict, list[str]], bytes | None]) -> Callable[[Path], None]:
    """Rewrite model.safetensors' header with ``edit(header, names in the order of their bytes)``; bytes it
    returns are appended to the data."""
    def apply(directory: Path) -> None:
        file = directory / "model.safetensors"
        raw = file.read_bytes()
        length = struct.unpack("<Q", raw[:8])[0]
        header, data = json.loads(raw[8: 8 + length]), raw[8 + length:]
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
        data += edit(header, names) or b""
        text = json.dumps(header).encode()
        file.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return apply


def _shift(name_index: int, by: int) -> Callable[[dict, list[str]], None]:
    def apply(header: dict, names: list[str]) -> None:
        offsets = header[names[name_index]]["data_offsets"]
        header[names[name_index]]["data_offsets"] = [offsets[0] + by, offsets[1] + by]
    return apply


def _deep_header(directory: Path) -> None:
    text = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)


NOT_SAFETENSORS = "model.safetensors is not a safetensors file"
PRETRAINED = {  # case -> (what is done to a copy of the Llama, what the line says)
    "config a list": (_config(lambda c: "[1, 2]"), "config.json holds a JSON list, not an object"),
    "config a string": (_config(lambda c: '"llama"'), "config.json holds a JSON str, not an object"),
    "config deep": (_config(lambda c: "[" * 100_000 + "]" * 100_000), "config.json (RecursionError"),
    "config not JSON": (_config(lambda c: "{"), "cannot read"),
    "model_type a list": (_config(lambda c: c.update(model_type=["llama"])), "config.json's model_type is ['llama']"),
    "100000 layers": (_config(lambda c: c.update(num_hidden_layers=100_000)),
                      "config.json's num_hidden_layers=100,000 is more layers than hpc builds (at most 2,048"),
    "0 layers": (_config(lambda c: c.update(num_hidden_layers=0)), "num_hidden_layers=0 must be an integer >= 1"),
    "-1 layers": (_config(lambda c: c.update(num_hidden_layers=-1)), "num_hidden_layers=-1 must be an integer >= 1"),
    "layers a string": (_config(lambda c: c.update(num_hidden_layers="2")), "num_hidden_layers='2' must be an"),
    "rms_norm_eps NaN": (_config(lambda c: c.update(rms_norm_eps=float("nan"))),
                         "config.json's rms_norm_eps=nan must be a finite number"),
    "rms_norm_eps 0": (_config(lambda c: c.update(rms_norm_eps=0)), "rms_norm_eps=0 must be a number above zero"),
    "rope_theta negative": (_config(lambda c: c.update(rope_theta=-1.0)), "rope_theta=-1.0 must be a number above"),
    "tie a string": (_config(lambda c: c.update(tie_word_embeddings="yes")),
                     "its config.json and model.args do not make a llama config"),
    "header deep": (_deep_header, f"{NOT_SAFETENSORS} (RecursionError"),
    "offsets past the file": (_header(_shift(-1, 10**9)), "run past the file's"),
    "offsets overlapping": (_header(_shift(1, -4)), "overlaps the tensor before it"),
    "offsets with a gap": (_header(lambda h, n: _shift(-1, 4)(h, n) or b"\0" * 4), "leaves bytes 139776-139780 unused"),
    "bytes left over": (_header(lambda h, n: b"\0" * 16), "the tensors' bytes end at"),
    "negative offset": (_header(lambda h, n: h[n[0]].update(data_offsets=[-4, h[n[0]]["data_offsets"][1]])),
                        "data_offsets [-4,"),
    "metadata a list": (_header(lambda h, n: h.update(__metadata__=["pt"])), "__metadata__ is ['pt'], not a table"),
    "metadata not strings": (_header(lambda h, n: h.update(__metadata__={"format": 1})), "not a table of strings"),
    "shape of booleans": (_header(lambda h, n: h[n[0]].update(shape=[*h[n[0]]["shape"], True])), "shape ["),
}


@pytest.mark.parametrize("case", list(PRETRAINED))
def test_a_damaged_pretrained_directory_is_one_line_before_launch(llama, tmp_path, no_slurm, case) -> None:
    directory = tmp_path / "llama"
    shutil.copytree(llama, directory)
    damage, message = PRETRAINED[case]
    damage(directory)
    spec = tmp_path / "job.toml"
    spec.write_text(f'[job]\nname = "pretrained"\nrun_dir = "{tmp_path / "runs"}"\n[model]\n'
                    f'entry = "jobs.models.hf:causal_lm"\nseq_len = 16\n[model.args]\npretrained = "{directory}"\n'
                    '[data]\nname = "licenses"\nbatch_size = 8\n')
    _run_and_submit(spec, [], message, tmp_path / "runs", no_slurm)
    err = _refused(["run", "--dry-run", "--launcher", "local", str(spec)], message, tmp_path / "runs")
    assert err.startswith(f"hpc: error: model.args.pretrained='{directory}': "), err


def test_the_safetensors_checks_refuse_what_safetensors_refuses(llama, tmp_path) -> None:
    """The header check is safetensors' own: every damaged header above safetensors cannot open either."""
    from safetensors import SafetensorError, safe_open

    for case in ("offsets past the file", "offsets overlapping", "offsets with a gap", "bytes left over",
                 "metadata a list", "metadata not strings"):
        directory = tmp_path / case.replace(" ", "-")
        shutil.copytree(llama, directory)
        PRETRAINED[case][0](directory)
        with pytest.raises(SafetensorError), safe_open(str(directory / "model.safetensors"), framework="pt"):
            pass
    with safe_open(str(llama / "model.safetensors"), framework="pt") as files:
        assert len(list(files.keys())) == 21


# --- checkpoint.init_from, and a device the backend cannot run on ----------------------------------------------

MLP = REPO / "jobs" / "examples" / "mlp.toml"


def _save_model(world, root: str, hidden: list[int] | None) -> None:
    """A checkpoint of the MLP of ``hidden`` sizes (None: of another model, one tensor ``model/w``)."""
    import torch
    import torch.distributed as dist

    from hpc.checkpoint import Checkpointer, Piece
    from hpc.config import load_spec
    from jobs.models.protocol import build_model
    from jobs.train.checkpointing import model_pieces

    saver = Checkpointer(root, dist.group.WORLD)
    if hidden is None:
        pieces = [Piece.whole("model/w", torch.ones(2))]
    else:
        pieces = model_pieces(build_model(load_spec(MLP, [f"model.hidden_sizes={hidden}"])))
    saver.save(1, pieces, attrs={"job_spec": "{}"})
    saver.finalize()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """root/mlp (the MLP of hidden sizes [16]), root/other (another model's), one complete checkpoint each."""
    from tests.ranks import run_ranks

    root = tmp_path_factory.mktemp("checkpoints")
    run_ranks(1, _save_model, str(root / "mlp"), [16])
    run_ranks(1, _save_model, str(root / "other"), None)
    return root


def _incomplete(root: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "incomplete"
    shutil.copytree(root / "mlp", copy)
    for marker in copy.glob("step-*/COMPLETE"):
        marker.unlink()
    return copy / "step-00000001"


INIT_FROM = {  # case -> (the path init_from names, from the checkpoints' root and tmp_path; what the line says)
    "missing": (lambda root, tmp: tmp / "nowhere", "nowhere: no such file or directory"),
    "a file": (lambda root, tmp: MLP, "mlp.toml: not a directory (a checkpoint is a step directory"),
    "no checkpoint there": (lambda root, tmp: tmp, "no complete checkpoint there"),
    "another model's": (lambda root, tmp: root / "other", "is not in"),
    "another shape": (lambda root, tmp: root / "mlp", "in this model (the [model] settings must match its run's)"),
    "incomplete": (_incomplete, "that checkpoint is incomplete"),
}


@pytest.mark.parametrize("case", list(INIT_FROM))
def test_init_from_what_this_model_cannot_start_from_is_one_line_before_launch(checkpoints, tmp_path, no_slurm,
                                                                               case) -> None:
    source, message = INIT_FROM[case][0](checkpoints, tmp_path), INIT_FROM[case][1]
    overrides = [f"job.run_dir={tmp_path / 'runs'}", "model.hidden_sizes=[8]", f"checkpoint.init_from={source}"]
    _run_and_submit(MLP, overrides, message, tmp_path / "runs", no_slurm)
    err = _refused(["run", "--dry-run", "--launcher", "local", str(MLP), *(x for o in overrides for x in ("--set", o))],
                   message, tmp_path / "runs")
    assert f"checkpoint.init_from={source}" in err, err


def test_init_from_this_model_s_checkpoint_passes(checkpoints, tmp_path) -> None:
    for source in (checkpoints / "mlp", checkpoints / "mlp" / "step-00000001"):
        code, out, err = _cli("run", "--dry-run", "--launcher", "local", str(MLP), "--set", "model.hidden_sizes=[16]",
                              "--set", f"job.run_dir={tmp_path / 'runs'}", "--set", f"checkpoint.init_from={source}")
        assert code == 0 and "RANK=0" in out and err == "", err


def test_nccl_on_the_cpu_is_one_line_before_launch(tmp_path, no_slurm) -> None:
    overrides = [f"job.run_dir={tmp_path / 'runs'}", "parallel.device=cpu", "parallel.backend=nccl"]
    _run_and_submit(MLP, overrides, "parallel.backend must be 'gloo' or 'auto' with device='cpu'", tmp_path / "runs",
                    no_slurm)


def test_a_run_directory_under_a_file_is_one_line_before_launch(tmp_path, no_slurm) -> None:
    """It failed every rank once started, with noise about failures that could not be recorded."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    _run_and_submit(MLP, [f"job.run_dir={a_file / 'runs'}"], f"job.run_dir={a_file / 'runs'}: {a_file} is a file, "
                    f"not a directory (the run's directory is {a_file / 'runs' / 'mlp-digits'})", tmp_path / "runs",
                    no_slurm)
    assert a_file.read_text() == "mine"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without a GPU")
def test_a_gpu_asked_for_where_none_is_is_one_line_before_hpc_run_launches(tmp_path) -> None:
    for override, message in (("parallel.device=cuda", "parallel.device='cuda' needs CUDA, and no GPU is visible"),
                              ("parallel.backend=nccl", "parallel.backend='nccl' needs parallel.device='cuda'")):
        _refused(["run", "--launcher", "local", str(MLP), "--set", f"job.run_dir={tmp_path / 'runs'}", "--set",
                  override], message, tmp_path / "runs")


# --- the odd ones: an empty --layout, an entry that exits, ckpt export --to under a file ------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["--layout", "", "--cluster", "x.toml", "--gpus", "2"], "--layout is empty: give dp=,tp=,pp="),
    (["--layout", " , ", "--cluster", "x.toml"], "--layout is empty"),
    (["--validate", "--layouts", "", str(MLP), "--cluster", "x.toml"], "--layouts is empty"),
    (["--validate", "--layouts", "dp=2,2x2 dp=4 cut", str(MLP), "--cluster", "h100-dgx"],
     "--layouts: '2x2 dp=4 cut' runs nodes of several ranks, which only the namespace testbed has: add --testbed"),
])
def test_an_empty_or_testbed_only_layout_is_refused_not_ignored(tmp_path, args, message) -> None:
    _refused(["plan", *args], message, tmp_path / "runs")


@pytest.mark.parametrize(("args", "message"), [
    (["--validate", str(MLP), "--cluster", "h100-dgx", "--testbed", "1zbit"],
     "--testbed: rate '1zbit' is not like 100mbit or 1gbit"),
    (["--validate", str(MLP), "--cluster", "h100-dgx", "--record", "{tmp}/missing/rows.json"],
     "--record {tmp}/missing/rows.json: the directory {tmp}/missing does not exist"),
    (["--validate", str(MLP), "--cluster", "h100-dgx", "--record", "{tmp}"], "--record {tmp}: a directory"),
    (["--calibrate", "--out", "{tmp}"], "--out {tmp}: a directory (give a file name)"),
    (["--calibrate", "--out", "{tmp}/file/cluster.toml"], "--out {tmp}/file/cluster.toml: cannot make the directory"),
])
def test_a_bad_output_or_rate_is_refused_before_measuring(tmp_path, monkeypatch, args, message) -> None:
    """Minutes of runs would be lost to a path or a rate found bad only at the end."""
    from jobs.bench import calibrate, plan_check

    def measured(*args, **kwargs):
        raise AssertionError("measured before the arguments were checked")

    monkeypatch.setattr(plan_check, "validate", measured)
    monkeypatch.setattr(calibrate, "calibrate", measured)
    (tmp_path / "file").write_text("x")
    _refused(["plan", *(arg.format(tmp=tmp_path) for arg in args)], message.format(tmp=tmp_path), tmp_path / "runs")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file"]


EXITS = {  # module text -> what the line says
    "def model(**kwargs):\n    raise SystemExit(3)\n": "model.entry='{name}:model' exited with code 3 instead of",
    "import sys\ndef model(**kwargs):\n    sys.exit('no model')\n": "exited with the message 'no model' instead of",
    "raise SystemExit(3)\n": "model.entry='{name}:model': importing '{name}' exited with code 3",
    "import sys\nsys.exit()\n": "importing '{name}' exited with code 0",
}


@pytest.mark.parametrize("text", list(EXITS), ids=range(len(EXITS)))
def test_an_entry_that_exits_is_named(tmp_path, monkeypatch, no_slurm, text) -> None:
    name = f"exits_{abs(hash(text))}"
    (tmp_path / f"{name}.py").write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = [f"job.run_dir={tmp_path / 'runs'}", f"model.entry={name}:model"]
    _run_and_submit(MLP, overrides, EXITS[text].format(name=name), tmp_path / "runs", no_slurm)


def test_an_entry_that_exits_on_a_rank_is_one_error_not_its_exit_code() -> None:
    from hpc.entry import call_entry
    from hpc.errors import ConfigError

    def data() -> None:
        raise SystemExit(3)

    with pytest.raises(ConfigError, match=r"^data.entry='m:data' exited with code 3 instead of returning$"):
        call_entry(data, {}, "m:data", "data.entry")


@pytest.fixture(scope="module")
def mlp_checkpoint(checkpoints) -> Path:
    return checkpoints / "mlp" / "step-00000001"


@pytest.mark.parametrize(("to", "message"), [
    ("/etc/hostname/sub.safetensors", "--to /etc/hostname/sub.safetensors: /etc/hostname is not a directory"),
    ("/etc/hostname/sub.pt", "/etc/hostname is not a directory"),
    ("/dev/null/x/y.safetensors", "/dev/null is not a directory"),
    ("{tmp}/nowhere/out.safetensors", "the directory {tmp}/nowhere does not exist"),
    ("{tmp}", "--to {tmp}: the file name must end in .safetensors or .pt"),
    ("{tmp}/dir.safetensors", "--to {tmp}/dir.safetensors: a directory (give a file name"),
])
def test_ckpt_export_to_where_no_file_can_be_is_one_line(mlp_checkpoint, tmp_path, to, message) -> None:
    (tmp_path / "dir.safetensors").mkdir()
    before = sorted(tmp_path.iterdir())
    _refused(["ckpt", "export", str(mlp_checkpoint), "--to", to.format(tmp=tmp_path)], message.format(tmp=tmp_path),
             tmp_path / "runs")
    assert sorted(tmp_path.iterdir()) == before
    assert _cli("ckpt", "export", str(mlp_checkpoint), "--to", str(tmp_path / "out.pt"))[0] == 0


def test_a_model_directory_under_a_file_is_one_line(tmp_path) -> None:
    from hpc.checkpoint.export import check_destination
    from hpc.checkpoint.format import CheckpointError

    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"file: not a directory \(--format hf writes"):
        check_destination(tmp_path / "file", directory=True)
    with pytest.raises(CheckpointError, match=r"/file is not a directory$"):
        check_destination(tmp_path / "file" / "sub" / "dir", directory=True)
    check_destination(tmp_path / "new" / "dir", directory=True)  # made with its parents
    assert not (tmp_path / "new").exists()
