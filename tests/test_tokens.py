"""Tokenized data: ``hpc data prepare`` (jobs/data/prepare.py) and the ``jobs.data.tokens:tokens`` data entry
(jobs/data/tokens.py).

The tokenizer is the example BPE that ships in jobs/examples (trained on Debian's license texts, no download).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpc.cli.main import main
from hpc.config import load_spec
from hpc.errors import ConfigError
from jobs.data import prepare as prep
from jobs.data.tokens import META, OFFSETS, TOKENIZER, TOKENS, TokenSet, held_out_documents, runs, tokens
from jobs.train.layout import check_token_set

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "jobs" / "examples" / "tokenizer.json"
LICENSES = Path("/usr/share/common-licenses")
EOS_ID = 0  # <|endoftext|>, the example tokenizer's only special token


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(EXAMPLE))


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _paragraphs(name: str) -> list[str]:
    text = (LICENSES / name).read_text()
    return [p.strip("\n") for p in __import__("re").split(r"\n(?:[ \t\r\f\v]*\n)+", text) if p.strip()]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> tuple[Path, list[str]]:
    """Documents of several paragraphs each, some non-ASCII, one empty, with a blank line in between."""
    paragraphs = _paragraphs("GPL-3") + _paragraphs("Apache-2.0")
    docs = ["\n\n".join(paragraphs[i: i + 5]) for i in range(0, len(paragraphs), 5)] + ["", "naïve café ✓ 東京"]
    path = tmp_path_factory.mktemp("jsonl") / "docs.jsonl"
    lines = [json.dumps({"id": i, "body": doc}) for i, doc in enumerate(docs)]
    path.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")
    return path, docs


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, jsonl) -> Path:
    out = tmp_path_factory.mktemp("sets") / "set"
    prep.prepare([jsonl[0]], str(EXAMPLE), out, text_field="body")
    return out


def test_jsonl_documents_decode_back_each_followed_by_the_eos(prepared, jsonl, hf_tokenizer) -> None:
    data, docs = TokenSet(prepared), jsonl[1]
    assert data.documents == len(docs) and data.tokens.dtype == np.dtype("<u2")
    assert data.offsets[0] == 0 and data.offsets[-1] == len(data.tokens)
    for index, doc in enumerate(docs):
        ids = data.document(index)
        assert ids[-1] == EOS_ID and EOS_ID not in ids[:-1]
        assert _decode(hf_tokenizer, ids[:-1]) == doc
    meta = data.meta
    assert meta["tokenizer"]["vocab_size"] == 4096 and meta["tokenizer"]["eos"] == "<|endoftext|>"
    assert meta["tokenizer"]["sha256"] == hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()
    assert (prepared / TOKENIZER).read_bytes() == EXAMPLE.read_bytes()
    [source] = meta["sources"]
    assert source["sha256"] == hashlib.sha256(jsonl[0].read_bytes()).hexdigest()
    assert source["documents"] == len(docs) and source["bytes"] == jsonl[0].stat().st_size
    assert sorted(p.name for p in prepared.parent.iterdir()) == ["set"]  # no temporary directory left


def test_plain_text_is_one_document_per_paragraph_in_file_order(tmp_path, hf_tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(prep, "BLOCK_BYTES", 100)  # paragraphs and blank lines cut across reads
    first, second = tmp_path / "a.txt", tmp_path / "b"
    first.write_text("\n\nFirst paragraph,\n  two lines.\n\n \t\n\nSecond one.\r\n\r\nThird\n")
    second.write_bytes((LICENSES / "BSD").read_bytes())
    prep.prepare([first, second], str(EXAMPLE), tmp_path / "out")
    data = TokenSet(tmp_path / "out")
    expected = ["First paragraph,\n  two lines.", "Second one.", "Third", *_paragraphs("BSD")]
    assert [_decode(hf_tokenizer, data.document(i)[:-1]) for i in range(data.documents)] == expected
    assert [s["documents"] for s in data.meta["sources"]] == [3, len(expected) - 3]


def test_the_same_input_gives_byte_identical_files(tmp_path, jsonl, monkeypatch) -> None:
    monkeypatch.setattr(prep, "CHUNK_CHARS", 3000)  # many chunks through the reader and writer threads
    outs = [tmp_path / "one", tmp_path / "two"]
    for out in outs:
        prep.prepare([jsonl[0], jsonl[0]], str(EXAMPLE), out, text_field="body")
    for name in (TOKENS, OFFSETS, TOKENIZER, META):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    assert TokenSet(outs[0]).documents == 2 * len(jsonl[1])


def test_a_vocabulary_past_uint16_is_stored_as_uint32(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["</s>"])
    tokenizer.save(str(tmp_path / "words.json"))
    (tmp_path / "in.txt").write_text("w69999 w3 w70000\n\nw0\n")
    prep.prepare([tmp_path / "in.txt"], str(tmp_path / "words.json"), tmp_path / "out")
    data = TokenSet(tmp_path / "out")
    assert data.meta["tokens"]["dtype"] == "uint32" and data.tokens.dtype == np.dtype("<u4")
    assert data.tokens.tolist() == [70_001, 5, 0, 1, 2, 1]


def test_a_transformers_directory_gives_its_eos_token(tmp_path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(EXAMPLE))
    tokenizer.add_special_tokens(["<|doc|>"])
    directory = tmp_path / "tok"
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|doc|>"}}))
    (tmp_path / "in.txt").write_text("Hello.\n\nWorld.\n")
    meta = prep.prepare([tmp_path / "in.txt"], str(directory), tmp_path / "out")
    doc_id = tokenizer.token_to_id("<|doc|>")
    assert meta["tokenizer"]["eos"] == "<|doc|>" and meta["tokenizer"]["eos_id"] == doc_id
    data = TokenSet(tmp_path / "out")
    assert data.document(0)[-1] == doc_id and data.document(1)[-1] == doc_id
    assert prep.prepare([tmp_path / "in.txt"], str(directory), tmp_path / "out2", eos="<|endoftext|>") \
        ["tokenizer"]["eos_id"] == EOS_ID


def test_parquet_reads_the_column_when_pyarrow_is_installed(tmp_path, jsonl, hf_tokenizer) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"n": list(range(len(jsonl[1]))), "body": jsonl[1]}), tmp_path / "docs.parquet",
                   row_group_size=7)
    prep.prepare([tmp_path / "docs.parquet"], str(EXAMPLE), tmp_path / "out", text_field="body")
    data = TokenSet(tmp_path / "out")
    assert [_decode(hf_tokenizer, data.document(i)[:-1]) for i in range(data.documents)] == jsonl[1]
    assert data.meta["sources"][0]["sha256"] == hashlib.sha256((tmp_path / "docs.parquet").read_bytes()).hexdigest()


def _errors(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "a"}\n')
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b",}\n')
    (tmp_path / "field.jsonl").write_text('{"text": "a"}\n\n{"body": "b"}\n')
    (tmp_path / "data.parquet").write_bytes(b"PAR1")
    (tmp_path / "exists").mkdir()
    no_eos = tmp_path / "no_eos.json"
    no_eos.write_text(EXAMPLE.read_text().replace('"special":true', '"special":false', 1))
    return {
        "missing file": ([str(tmp_path / "nothing.txt")], "nothing.txt: no such file"),
        "bad JSON": ([str(tmp_path / "bad.jsonl")], "bad.jsonl:2: not JSON"),
        "missing field": ([str(tmp_path / "field.jsonl")], "field.jsonl:3: no field 'text'"),
        "unknown tokenizer": (["--tokenizer", str(tmp_path / "nope"), str(good)], "no such file or directory"),
        "tokenizer without EOS": (["--tokenizer", str(no_eos), str(good)], "give --eos TOKEN"),
        "EOS not a token": (["--eos", "<s>", str(good)], "--eos '<s>' is not a token"),
        "out exists": (["--out", str(tmp_path / "exists"), str(good)], "exists and is an empty directory"),
        "Parquet without pyarrow": ([str(tmp_path / "data.parquet")], "pip install pyarrow"),
    }


@pytest.mark.parametrize("case", ["missing file", "bad JSON", "missing field", "unknown tokenizer",
                                  "tokenizer without EOS", "EOS not a token", "out exists", "Parquet without pyarrow"])
def test_a_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, monkeypatch, case) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # the error a machine without pyarrow gives
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    args, message = _errors(tmp_path)[case]
    options = {"--tokenizer": str(EXAMPLE), "--out": str(tmp_path / "out")}
    for key in options:
        if key in args:
            options[key] = args.pop(args.index(key) + 1)
            args.remove(key)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["data", "prepare", *(x for pair in options.items() for x in pair), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpc: error: ") and err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_an_interrupted_prepare_leaves_no_directory(tmp_path, jsonl, monkeypatch) -> None:
    monkeypatch.setattr(prep, "CHUNK_CHARS", 2000)
    appended = []

    def interrupt(self, encodings) -> None:
        appended.append(len(encodings))
        if len(appended) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(prep.TokenWriter, "append", interrupt)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare([jsonl[0]], str(EXAMPLE), tmp_path / "out", text_field="body")
    assert len(appended) >= 3 and list(tmp_path.iterdir()) == []


def test_a_killed_prepare_leaves_no_directory_and_the_next_run_clears_its_leftovers(tmp_path, jsonl) -> None:
    """SIGKILL mid-write: ``out`` never appears; its ``out.tmp-PID`` goes when the next run starts."""
    script = ("import sys, os, signal; from jobs.data import prepare as p\n"
              "real = p.TokenWriter.append\n"
              "def append(self, encodings):\n"
              "    real(self, encodings); os.kill(os.getpid(), signal.SIGKILL)\n"
              "p.TokenWriter.append = append; p.CHUNK_CHARS = 2000\n"
              f"p.prepare([{str(jsonl[0])!r}], {str(EXAMPLE)!r}, {str(tmp_path / 'out')!r}, text_field='body')\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    [left] = tmp_path.iterdir()
    assert left.name.startswith("out.tmp-") and (left / TOKENS).exists() and not (left / META).exists()
    prep.prepare([jsonl[0]], str(EXAMPLE), tmp_path / "out", text_field="body")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_set_another_run_published_meanwhile_is_left_whole(tmp_path, jsonl, monkeypatch) -> None:
    (tmp_path / "in.txt").write_text("one\n\ntwo\n")
    real = prep.write_set

    def other_run_first(directory, *args):
        meta = real(directory, *args)
        monkeypatch.setattr(prep, "write_set", real)
        prep.prepare([tmp_path / "in.txt"], str(EXAMPLE), tmp_path / "out")  # the other run, done first
        return meta

    monkeypatch.setattr(prep, "write_set", other_run_first)
    with pytest.raises(ConfigError, match="appeared while this run prepared it"):
        prep.prepare([jsonl[0]], str(EXAMPLE), tmp_path / "out", text_field="body")
    assert TokenSet(tmp_path / "out").documents == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out"]


def test_force_replaces_a_set_once_the_new_one_is_complete(tmp_path, jsonl) -> None:
    (tmp_path / "in.txt").write_text("one\n\ntwo\n")
    prep.prepare([tmp_path / "in.txt"], str(EXAMPLE), tmp_path / "out")
    prep.prepare([jsonl[0]], str(EXAMPLE), tmp_path / "out", text_field="body", force=True)
    assert TokenSet(tmp_path / "out").documents == len(jsonl[1])
    assert [p.name for p in tmp_path.iterdir() if p.name != "in.txt"] == ["out"]


# --- the data entry ---------------------------------------------------------------------------------


def test_windows_are_pure_in_seed_and_step_and_within_the_vocabulary(prepared) -> None:
    first, again = tokens(str(prepared), seq_len=32), tokens(str(prepared), seq_len=32)
    batches = [first.train.batch_indices(step, 8, seed=1) for step in range(3)]
    assert all(np.array_equal(a, again.train.batch_indices(s, 8, seed=1)) for s, a in enumerate(batches))
    assert not np.array_equal(batches[0], batches[1])
    assert not np.array_equal(batches[0], first.train.batch_indices(0, 8, seed=2))
    inputs, targets = first.train.windows(batches[0])
    assert inputs.shape == targets.shape == (8, 32) and inputs.dtype == targets.dtype == __import__("torch").int64
    assert (inputs[:, 1:] == targets[:, :-1]).all()
    assert int(inputs.min()) >= 0 and int(targets.max()) < 4096
    assert all(0 <= i < len(first.train) for i in batches[0])


def test_the_held_out_set_is_whole_documents_the_training_windows_never_touch(prepared) -> None:
    data = TokenSet(prepared)
    splits = tokens(str(prepared), seq_len=16, held_out=0.2, split_seed=3)
    mask = held_out_documents(data.documents, 0.2, 3)
    assert mask.sum() == round(0.2 * data.documents) and not mask.all()
    assert np.array_equal(mask, held_out_documents(data.documents, 0.2, 3))
    held_positions = np.concatenate([np.arange(data.offsets[d], data.offsets[d + 1]) for d in np.flatnonzero(mask)])
    train = splits.train.file_positions(np.arange(len(splits.train)))
    assert not np.isin(train, held_positions).any()
    held = splits.held_out.file_positions(np.arange(len(splits.held_out)) * 16)
    assert np.isin(held, held_positions).all()
    starts, lengths = runs(data.offsets, ~mask)
    assert lengths.sum() + len(held_positions) == len(data.tokens) and len(starts) >= 1


def test_a_set_whose_ids_pass_the_model_vocabulary_is_refused_before_any_rank(prepared, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"data.args.path=.* 4,096 ids .* vocabulary of 100"):
        tokens(str(prepared), seq_len=16, vocab_size=100)
    base = REPO / "jobs" / "examples" / "gpt_tokens.toml"
    spec = load_spec(base, [f"data.args.path={prepared}", "model.args.vocab_size=4000"])
    with pytest.raises(ConfigError, match=r"more than the model's vocabulary \(model.args.vocab_size\) of 4,000"):
        check_token_set(spec)
    check_token_set(load_spec(base, [f"data.args.path={prepared}"]))
    with pytest.raises(ConfigError, match=r"data.args.path='.*nowhere' does not exist"):
        check_token_set(load_spec(base, [f"data.args.path={tmp_path / 'nowhere'}"]))


def test_a_model_entry_without_vocab_size_is_checked_by_its_input_embedding(prepared, tmp_path, monkeypatch) -> None:
    (tmp_path / "small_lm.py").write_text(
        "import torch\n"
        "class LM(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.embed = torch.nn.Embedding(1000, 8); self.head = torch.nn.Linear(8, 1000)\n"
        "    def forward(self, x): return self.head(self.embed(x))\n"
        "    def loss(self, out, y): return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())\n"
        "def lm(): return LM()\n")
    monkeypatch.chdir(tmp_path)
    spec = load_spec(REPO / "jobs" / "examples" / "gpt_tokens.toml",
                     ["model.entry=small_lm:lm", "model.args={}", f"data.args.path={prepared}"])
    with pytest.raises(ConfigError, match="input embedding of 1,000"):
        check_token_set(spec)


@pytest.mark.slow
def test_the_gpt_trains_on_a_prepared_set_under_hpc_run(tmp_path) -> None:
    """docs/USER_MODELS.md's workflow: prepare the license texts with the example tokenizer, hpc run -n 1 the GPT
    on it."""
    out = tmp_path / "licenses-bpe"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    hpc = [sys.executable, "-m", "hpc.cli.main"]
    files = sorted(str(p) for p in LICENSES.iterdir() if p.is_file())
    done = subprocess.run([*hpc, "data", "prepare", "--tokenizer", str(EXAMPLE), "--out", str(out), *files],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "uint16, vocabulary 4,096" in done.stdout, done.stderr
    run = subprocess.run([*hpc, "run", "-n", "1", "--launcher", "local", "jobs/examples/gpt_tokens.toml",
                          "--set", f"data.args.path={out}", "--set", f"job.run_dir={tmp_path / 'runs'}",
                          "--set", "train.steps=6", "--set", "train.log_every=3", "--set", "model.args.n_layers=1"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "summary: 6 steps" in run.stdout and "held-out loss" in run.stdout, run.stdout
