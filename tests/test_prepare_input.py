"""``hpc data prepare`` on bad input (issue 45): one ``hpc: error:`` line naming the path, exit 2, no traceback,
no ``OUT``, no temporary directory, and nothing deleted that it did not write (``--force`` replaces only a set a
previous run wrote; what else was there, the inputs above all, survives byte for byte).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.cli.main import main
from jobs.data import prepare as prep
from jobs.data.tokens import META, TOKENIZER, TokenSet

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "jobs" / "examples" / "tokenizer.json"


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` (links not followed): a file's sha256, a link's target, ``dir`` or ``other``."""
    found = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = "-> " + os.readlink(path)
            elif path.is_dir():
                found[key] = "dir"
            elif path.is_file():
                found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[key] = "other"  # a FIFO: never opened
    return found


def _refused(capsys, args: list[str], names: str, tokenizer: Path | str = EXAMPLE) -> str:
    """``hpc data prepare`` with ``args`` exits 2 with one ``hpc: error:`` line naming ``names``."""
    assert main(["data", "prepare", "--tokenizer", str(tokenizer), *args]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("hpc: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert names in err, err
    assert captured.out == ""
    return err


def _set(directory: Path, text: str = "one\n\ntwo\n") -> Path:
    """A token set a previous run wrote."""
    source = directory.parent / f"{directory.name}-source.txt"
    source.write_text(text)
    prep.prepare([source], str(EXAMPLE), directory)
    source.unlink()
    return directory


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Path:
    """The working directory of a careless user: an input, a precious directory, a set prepare wrote."""
    monkeypatch.chdir(tmp_path)
    Path("in.txt").write_text("hello world\n\nsecond document\n")
    Path("precious").mkdir()
    Path("precious/a.txt").write_text("keep\n")
    _set(tmp_path / "old-set")
    return tmp_path


# --- --force deletes nothing it did not write --------------------------------------------------------------


def _force_case(case: str, root: Path) -> tuple[list[str], str]:
    """(--out and inputs, what the error names) for one thing --force must leave alone."""
    if case == "a directory of other files":
        return ["--out", "precious", "in.txt"], "precious exists and holds a.txt, which hpc data prepare does not"
    if case == "a set with one file more":
        (root / "old-set" / "notes.md").write_text("mine\n")
        return ["--out", "old-set", "in.txt"], "holds notes.md"
    if case == "a set file that is a directory":
        (root / "old-set" / TOKENIZER).unlink()
        (root / "old-set" / TOKENIZER).mkdir()
        return ["--out", "old-set", "in.txt"], "its tokenizer.json is a directory"
    if case == "a meta.json of another format":
        (root / "old-set" / META).write_text(json.dumps({"format": "mine", "version": 1}))
        return ["--out", "old-set", "in.txt"], "has no meta.json of format 'hpc-tokens'"
    if case == "a meta.json that is not JSON":
        (root / "old-set" / META).write_text("{not json")
        return ["--out", "old-set", "in.txt"], "holds a meta.json that is not JSON"
    if case == "an empty directory":
        (root / "empty").mkdir()
        return ["--out", "empty", "in.txt"], "empty exists and is an empty directory"
    if case == "a link to a set":
        (root / "link").symlink_to("old-set")
        return ["--out", "link", "in.txt"], "link exists and is a symbolic link"
    if case == "a link to a directory":
        (root / "link").symlink_to("precious")
        return ["--out", "link", "in.txt"], "link exists and is a symbolic link"
    if case == "a file":
        (root / "notes.txt").write_text("mine\n")
        return ["--out", "notes.txt", "in.txt"], "notes.txt exists and is a file"
    if case == "the input":
        return ["--out", "in.txt", "in.txt"], "--out in.txt is the input file in.txt"
    if case == "a set holding the input":
        return ["--out", "old-set", "old-set/meta.json"], "--out old-set holds the input file old-set/meta.json"
    if case == "a directory holding the input":
        return ["--out", "precious", "precious/a.txt"], "--out precious holds the input file precious/a.txt"
    assert case == "a directory holding the input by a link"
    (root / "alias").symlink_to("precious/a.txt")
    return ["--out", "precious", "alias"], "--out precious holds the input file alias"


FORCE_CASES = ["a directory of other files", "a set with one file more", "a set file that is a directory",
               "a meta.json of another format", "a meta.json that is not JSON", "an empty directory",
               "a link to a set", "a link to a directory", "a file", "the input", "a set holding the input",
               "a directory holding the input", "a directory holding the input by a link"]


@pytest.mark.parametrize("force", [True, False], ids=["force", "no-force"])
@pytest.mark.parametrize("case", FORCE_CASES)
def test_force_replaces_nothing_but_a_set_prepare_wrote(scratch, capsys, case, force) -> None:
    args, names = _force_case(case, scratch)
    before = _snapshot(scratch)
    err = _refused(capsys, [*args, *["--force"] * force], names)
    assert _snapshot(scratch) == before
    if "exists and" in err:
        assert "choose another --out (--force replaces only a token set" in err


def test_the_issue_reproduction_keeps_precious(scratch, capsys) -> None:
    """``mkdir precious && echo keep > precious/a.txt && hpc data prepare ... --out precious --force in.txt``."""
    _refused(capsys, ["--out", "precious", "--force", "in.txt"], "precious exists and holds a.txt")
    assert (scratch / "precious" / "a.txt").read_text() == "keep\n"


def test_force_still_replaces_a_set_and_removes_only_its_files(scratch, capsys) -> None:
    assert main(["data", "prepare", "--tokenizer", str(EXAMPLE), "--out", "old-set", "--force", "in.txt"]) == 0
    assert TokenSet(scratch / "old-set").documents == 2 and "old-set: 2 documents" in capsys.readouterr().out
    assert sorted(os.listdir(scratch)) == ["in.txt", "old-set", "precious"]


def test_a_set_that_changed_while_this_run_prepared_it_is_left(scratch, monkeypatch) -> None:
    """--force checks the set again when it publishes: a file added meanwhile keeps it where it is."""
    real = prep.write_set

    def meanwhile(directory, *args):
        (scratch / "old-set" / "added.txt").write_text("mine\n")
        return real(directory, *args)

    monkeypatch.setattr(prep, "write_set", meanwhile)
    with pytest.raises(prep.ConfigError, match=r"appeared while this run prepared it, and holds added\.txt"):
        prep.prepare(["in.txt"], str(EXAMPLE), "old-set", force=True)
    assert (scratch / "old-set" / "added.txt").read_text() == "mine\n"
    assert sorted(os.listdir(scratch)) == ["in.txt", "old-set", "precious"]


def test_a_dead_runs_leftover_is_removed_only_when_it_holds_nothing_else(scratch) -> None:
    ours, other = scratch / "out.tmp-999999999-abcd1234", scratch / "out.tmp-999999998-abcd1234"
    for leftover in (ours, other):
        leftover.mkdir()
        (leftover / "tokens.bin").write_bytes(b"\0\0")
    (other / "mine.txt").write_text("keep\n")
    prep.prepare(["in.txt"], str(EXAMPLE), "out")
    assert not ours.exists() and (other / "mine.txt").read_text() == "keep\n"


# --- --out that cannot be written ----------------------------------------------------------------------------


@pytest.fixture
def locked(tmp_path) -> Path:
    """A directory nobody may create anything in: immutable (chattr +i) as root, else read-only."""
    directory = tmp_path / "locked"
    directory.mkdir()
    if os.geteuid() == 0:
        done = subprocess.run(["chattr", "+i", str(directory)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"chattr +i: {done.stderr.decode().strip()}")
        yield directory
        subprocess.run(["chattr", "-i", str(directory)], check=True)
    else:
        directory.chmod(0o555)
        yield directory
        directory.chmod(0o755)


def _out_case(case: str, root: Path, locked: Path, monkeypatch) -> tuple[list[str], str]:
    if case == "dot":
        return ["--out", ".", "in.txt"], "--out .: names no directory of its own"
    if case == "root":
        return ["--out", "/", "in.txt"], "--out /: names no directory of its own"
    if case == "dot dot":
        return ["--out", "precious/..", "in.txt"], "--out precious/..: names no directory of its own"
    if case == "empty":
        return ["--out", "", "in.txt"], "--out : names no directory of its own"
    if case == "/dev/null":
        return ["--out", "/dev/null", "in.txt"], "--out /dev/null exists and is a character device"
    if case == "parent is a file":
        (root / "notes.txt").write_text("mine\n")
        return ["--out", "notes.txt/deeper/set", "in.txt"], "its parent notes.txt is a file, not a directory"
    if case == "inside the input":
        return ["--out", "in.txt/set", "in.txt"], "--out in.txt/set is inside the input file in.txt"
    if case == "name too long":
        return ["--out", "x" * 250, "in.txt"], "its name is 250 bytes, longer than the"
    if case == "name too long in bytes":
        return ["--out", "é" * 120, "in.txt"], "its name is 240 bytes"
    if case == "path too long":
        deep = "/".join(["d" * 200] * 25)
        return ["--out", f"{deep}/set", "in.txt"], "File name too long"
    if case == "locked parent":
        return ["--out", str(locked / "set"), "in.txt"], f"cannot create a directory in {locked}"
    if case == "locked grandparent":
        return ["--out", str(locked / "new" / "set"), "in.txt"], f"cannot create a directory in {locked}"
    assert case == "mkdtemp refused"

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(root / "deep" / "set.tmp-1-x"))

    monkeypatch.setattr(prep.tempfile, "mkdtemp", refuse)
    return ["--out", "deep/set", "in.txt"], "--out deep/set: cannot create a directory in"


OUT_CASES = ["dot", "root", "dot dot", "empty", "/dev/null", "parent is a file", "inside the input",
             "name too long", "name too long in bytes", "path too long", "locked parent", "locked grandparent",
             "mkdtemp refused"]


@pytest.mark.parametrize("force", [True, False], ids=["force", "no-force"])
@pytest.mark.parametrize("case", OUT_CASES)
def test_an_out_that_cannot_be_written_is_one_line(scratch, locked, capsys, monkeypatch, case, force) -> None:
    args, names = _out_case(case, scratch, locked, monkeypatch)
    before = _snapshot(scratch)
    _refused(capsys, [*args, *["--force"] * force], names)
    assert _snapshot(scratch) == before  # no OUT, no OUT.tmp-*, no parent it made


# --- writes that fail --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("limit", "failing", "ignore"), [
    (200_000, "tokens.bin", True), (200_000, "tokens.bin", False), (100_000, "tokenizer.json", True)],
    ids=["tokens-SIGXFSZ-ignored", "tokens-SIGXFSZ-default", "tokenizer-copy"])
def test_a_file_size_limit_is_one_line_and_leaves_nothing(tmp_path, limit, failing, ignore) -> None:
    """``ulimit -f``: EFBIG from the writer (hpc ignores SIGXFSZ while it prepares, so the default kills nothing)."""
    words = " ".join(f"w{i}" for i in range(60_000)) if failing == "tokens.bin" else "a few words"
    (tmp_path / "in.txt").write_text(words + "\n")
    before = _snapshot(tmp_path)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        if ignore:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    done = subprocess.run([sys.executable, "-m", "hpc.cli.main", "data", "prepare", "--tokenizer", str(EXAMPLE),
                           "--out", "set", "in.txt"], cwd=tmp_path, preexec_fn=limited, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr == (f"hpc: error: --out set: cannot write {failing} (File too large, past the file size "
                           "limit? ulimit -f)\n")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EDQUOT])
@pytest.mark.parametrize("where", ["write", "fsync"])
def test_a_failing_disk_is_one_line_and_leaves_nothing(scratch, capsys, monkeypatch, code, where) -> None:
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    if where == "write":
        monkeypatch.setattr(prep.TokenWriter, "append", fail)
    else:
        monkeypatch.setattr(prep.os, "fsync", fail)
    before = _snapshot(scratch)
    err = _refused(capsys, ["--out", "new/set", "in.txt"], "--out new/set: cannot write")
    assert os.strerror(code) in err
    assert _snapshot(scratch) == before


# --- inputs that cannot be read ------------------------------------------------------------------------------


class _FailingFile:
    def __init__(self, code: int) -> None:
        self.code = code

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def close(self) -> None:
        return None

    def read(self, size: int = -1) -> bytes:
        raise OSError(self.code, os.strerror(self.code))


def _reading(fail):
    """``open`` as jobs.data.prepare calls it, ``fail(path)`` in place of opening a file to read."""
    def opened(path, mode="r", *args, **kwargs):
        return fail(path) if "r" in mode else open(path, mode, *args, **kwargs)

    return opened


def _input_case(case: str, root: Path, monkeypatch) -> tuple[list[str], str]:
    if case == "a read error":
        return ["/proc/self/mem"], "/proc/self/mem: cannot read it (Input/output error, at byte 0)"
    if case == "EIO on a file":
        monkeypatch.setattr(prep, "open", _reading(lambda path: _FailingFile(errno.EIO)), raising=False)
        return ["in.txt"], "in.txt: cannot read it (Input/output error, at byte 0)"
    if case == "EIO on a JSONL file":
        (root / "docs.jsonl").write_text('{"text": "a"}\n')
        monkeypatch.setattr(prep, "open", _reading(lambda path: _FailingFile(errno.EIO)), raising=False)
        return ["docs.jsonl"], "docs.jsonl: cannot read it (Input/output error"
    if case == "permission denied":
        def denied(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

        monkeypatch.setattr(prep, "open", _reading(denied), raising=False)
        return ["in.txt"], "in.txt: cannot read it (Permission denied)"
    if case == "mode 000":
        if os.geteuid() == 0:
            pytest.skip("root reads a file of mode 000")
        (root / "in.txt").chmod(0)
        return ["in.txt"], "in.txt: cannot read it (Permission denied)"
    if case == "a directory":
        return ["precious"], "precious: is a directory"
    if case == "a device":
        return ["/dev/zero"], "/dev/zero: is a character device, not a file"
    if case == "a FIFO":
        os.mkfifo(root / "pipe")
        return ["pipe"], "pipe: is a FIFO, not a file"
    if case == "a name too long":
        return ["y" * 300], "File name too long"
    assert case == "a dangling link"
    (root / "dangling").symlink_to("nowhere")
    return ["dangling"], "dangling: no such file"


INPUT_CASES = ["a read error", "EIO on a file", "EIO on a JSONL file", "permission denied", "mode 000",
               "a directory", "a device", "a FIFO", "a name too long", "a dangling link"]


@pytest.mark.parametrize("case", INPUT_CASES)
def test_an_input_that_cannot_be_read_is_one_line(scratch, capsys, monkeypatch, case) -> None:
    args, names = _input_case(case, scratch, monkeypatch)
    before = _snapshot(scratch)
    _refused(capsys, ["--out", "set", *args], names)
    assert _snapshot(scratch) == before


# --- documents that are not --------------------------------------------------------------------------------


def _document_case(case: str, root: Path) -> tuple[list[str], str]:
    deep = "[" * 100_000 + "]" * 100_000
    lines = {
        "nested 100,000 deep": ('{"text": "a"}\n{"text": ' + deep + '}\n', "docs.jsonl:2: JSON nested too deep"),
        "nested deep in another field": ('{"text": "a", "x": ' + deep + '}\n', "docs.jsonl:1: JSON nested too deep"),
        "a lone surrogate": ('{"text": "a"}\n{"text": "a\\ud800b"}\n',
                             "docs.jsonl:2: the field 'text' holds a lone surrogate '\\ud800' at character 1"),
        "a lone low surrogate": ('{"text": "\\udfff"}\n', "docs.jsonl:1: the field 'text' holds a lone surrogate"),
        "a reversed pair": ('{"text": "\\ude00\\ud83d"}\n', "docs.jsonl:1: the field 'text' holds a lone surrogate"),
    }
    if case in lines:
        (root / "docs.jsonl").write_text(lines[case][0])
        return ["docs.jsonl"], lines[case][1]
    if case == "a surrogate as CESU-8 bytes":
        (root / "docs.jsonl").write_bytes(b'{"text": "a\xed\xa0\x80"}\n')
        return ["docs.jsonl"], "docs.jsonl:1: the field 'text' holds a lone surrogate"
    files = {"an empty file": {"empty.txt": ""}, "blank lines only": {"blank.txt": "\n  \n\t\n\r\n"},
             "an empty JSONL file": {"docs.jsonl": "\n\n"},
             "several empty files": {"a.txt": "", "b.jsonl": "\n", "c.txt": " \n"}}[case]
    for name, text in files.items():
        (root / name).write_text(text)
    return list(files), f"{', '.join(files)}: no documents (empty, or blank lines only)"


DOCUMENT_CASES = ["nested 100,000 deep", "nested deep in another field", "a lone surrogate", "a lone low surrogate",
                  "a reversed pair", "a surrogate as CESU-8 bytes", "an empty file", "blank lines only",
                  "an empty JSONL file", "several empty files"]


@pytest.mark.parametrize("case", DOCUMENT_CASES)
def test_a_document_that_is_none_is_one_line(scratch, capsys, case) -> None:
    args, names = _document_case(case, scratch)
    before = _snapshot(scratch)
    _refused(capsys, ["--out", "set", "--force", *args], names)
    assert _snapshot(scratch) == before


def test_a_surrogate_pair_is_one_character_and_prepared(scratch) -> None:
    (scratch / "docs.jsonl").write_text('{"text": "smile \\ud83d\\ude00"}\n')
    assert prep.prepare(["docs.jsonl"], str(EXAMPLE), "set")["documents"] == 1


# --- the end-of-document token ---------------------------------------------------------------------------------


def _eos_case(case: str, root: Path) -> tuple[list[str], str, Path]:
    directory = root / "tok"
    directory.mkdir()
    (directory / TOKENIZER).write_bytes(EXAMPLE.read_bytes())
    if case == "--eos ''":
        return ["--eos", ""], "--eos '': no token named", EXAMPLE
    if case == "--eos '' with a directory":
        return ["--eos", ""], "--eos '': no token named", directory
    if case == "tokenizer_config.json":
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
        return [], f"{directory}/tokenizer_config.json: eos_token '<nope>' is not a token of --tokenizer", directory
    if case == "tokenizer_config.json, added-token form":
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
        return [], "tokenizer_config.json: eos_token '</s>' is not a token", directory
    assert case == "special_tokens_map.json"
    (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<eos-missing>"}))
    return [], f"{directory}/special_tokens_map.json: eos_token '<eos-missing>' is not a token", directory


@pytest.mark.parametrize("case", ["--eos ''", "--eos '' with a directory", "tokenizer_config.json",
                                  "tokenizer_config.json, added-token form", "special_tokens_map.json"])
def test_an_eos_that_is_no_token_names_where_it_came_from(scratch, capsys, case) -> None:
    args, names, tokenizer = _eos_case(case, scratch)
    before = _snapshot(scratch)
    err = _refused(capsys, ["--out", "set", *args, "in.txt"], names, tokenizer)
    assert ("--eos" in err) == ("--eos ''" in case) or "give --eos TOKEN" in err
    assert _snapshot(scratch) == before


# --- Ctrl-C -----------------------------------------------------------------------------------------------


def test_ctrl_c_in_prepare_says_interrupted_not_ranks(scratch, capsys, monkeypatch) -> None:
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "prepare", interrupted)
    assert main(["data", "prepare", "--tokenizer", str(EXAMPLE), "--out", "set", "in.txt"]) == 130
    assert capsys.readouterr().err == "hpc: interrupted\n"
