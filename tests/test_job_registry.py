"""The job registry behind ``hpc status``, ``hpc logs`` and ``hpc cancel``: a damaged or foreign file in it is one
line naming that file, never a traceback, and files that are not records are passed over."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.cli.main import main
from slurm.job_registry import JobLookupError, JobRecord, Registry

DAMAGED = [
    ("garbage", "Expecting value: line 1 column 1 (char 0)"),
    ("", "Expecting value: line 1 column 1 (char 0)"),
    ("[]", "not a JSON object"),
    ("{}", "no job_id"),
    ('{"job_id": "100", "name": "x", "ranks": "2", "log_dir": "l", "run_paths": ["r"]}', "ranks is not of type int"),
    ('{"job_id": "100", "name": "x", "ranks": 2, "log_dir": "l", "run_paths": [3]}', "run_paths holds a non-string"),
    ('{"job_id": "100", "name": "x", "ranks": 2, "log_dir": "l", "run_paths": [], "extra": 1}', "an unknown key extra"),
]


@pytest.mark.parametrize(("text", "problem"), DAMAGED)
def test_a_damaged_record_is_one_line_naming_its_file(tmp_path: Path, text: str, problem: str) -> None:
    registry = Registry(tmp_path / "jobs")
    registry.add(JobRecord("99", "fine", 2, "logs", ("runs/fine",)))
    (registry.root / "100.json").write_text(text)
    expected = (f"{registry.root / '100.json'} is not a job record hpc submit or hpc sweep wrote ({problem}): move it "
                f"out of {registry.root}")
    for lookup in (lambda: registry.get("100"), registry.recent):
        with pytest.raises(JobLookupError) as failed:
            lookup()
        assert str(failed.value) == expected
    assert registry.get("99") == JobRecord("99", "fine", 2, "logs", ("runs/fine",))


def test_files_that_are_not_records_are_passed_over_and_a_directory_is_named(tmp_path: Path, capsys,
                                                                              monkeypatch) -> None:
    registry = Registry(tmp_path / "jobs")
    registry.add(JobRecord("99", "fine", 2, "logs", ("runs/fine",)))
    (registry.root / "notes.json").write_text("mine")
    assert registry.recent() == [registry.get("99")]
    (registry.root / "102.json").mkdir()
    monkeypatch.setenv("HPC_HOME", str(tmp_path))
    assert main(["logs", "102"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hpc: error: {registry.root / '102.json'} is not a job record hpc submit or hpc sweep "
                          "wrote ([Errno 21] Is a directory") and err.count("\n") == 1
