"""Outputs are written all or none: atomic files and folders, a full disk or an unwritable target as one line,
progress lines with rate and ETA."""

from __future__ import annotations

import errno
import io
import re

import pytest

from gpt2.core.atomic import atomic_dir, atomic_file, write_json
from gpt2.core.errors import UserError
from gpt2.core.progress import Progress


def test_disk_full_is_explained_and_leaves_nothing(tmp_path):
    with pytest.raises(UserError, match="writing .*out failed: disk full; free some space"):
        with atomic_dir(tmp_path / "out", owns=("*.bin",), command="test") as tmp:
            (tmp / "a.bin").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_replaces_old_output_only_on_success(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "out", owns=("*.txt",), command="test") as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("crash")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["old.txt"]
    with atomic_dir(tmp_path / "out", owns=("*.txt",), command="test") as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new.txt"]


def test_a_folder_holding_what_the_command_does_not_write_is_refused_untouched(tmp_path, monkeypatch):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    (tmp_path / "mine" / "a.txt").write_text("old output")
    with pytest.raises(UserError, match=r"mine holds thesis.tex, which test does not write; .*new or empty folder"):
        with atomic_dir(tmp_path / "mine", owns=("*.txt",), command="test"):
            pytest.fail("started work in a user's folder")
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["a.txt", "thesis.tex"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="file is a file; test writes a folder there"):
        with atomic_dir(tmp_path / "file", owns=("*",), command="test"):
            pass
    monkeypatch.chdir(tmp_path / "mine")  # "." is refused the same way, not a ValueError
    with pytest.raises(UserError, match="holds thesis.tex"):
        with atomic_dir(".", owns=("*.txt",), command="test"):
            pass
    (tmp_path / "empty").mkdir()
    with atomic_dir(tmp_path / "empty", owns=("*.txt",), command="test") as tmp:  # an empty folder is fine
        (tmp / "b.txt").write_text("new")
    assert [p.name for p in (tmp_path / "empty").iterdir()] == ["b.txt"]


def test_atomic_file(tmp_path):
    write_json(tmp_path / "m.json", {"a": 1})
    with pytest.raises(KeyboardInterrupt):
        with atomic_file(tmp_path / "m.json") as tmp:
            tmp.write_text("{half")
            raise KeyboardInterrupt
    assert (tmp_path / "m.json").read_text() == '{\n  "a": 1\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_progress_line_has_rate_and_eta():
    stream = io.StringIO()
    with Progress("tokenize", total=4e6, stream=stream, interval_s=0) as progress:
        progress.update(1e6)
        assert re.search(r"1.0MB/4.0MB \(25%\) [0-9.]+[KMG]?B/s ETA \d+:\d\d:\d\d", progress.line())
        progress.update(3e6)
    assert stream.getvalue().splitlines()[-1].startswith("tokenize: 4.0MB/4.0MB (100%)")


def test_a_stages_files_are_written_all_or_none(tmp_path, monkeypatch):
    """The disk fills at the third of five report files: none of them is new, no temporary is left."""
    import os

    from gpt2.core.atomic import write_files

    write_files(tmp_path, {"a.tsv": "old", "plots/b.png": b"old"})
    calls, fsync = [], os.fsync

    def fills_up(fd):
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", fills_up)
    new = {"a.tsv": "new", "plots/b.png": b"new", "c.json": "{}", "d.json": "{}", "e.md": "new"}
    with pytest.raises(UserError, match=r"writing .* failed: disk full; free some space"):
        write_files(tmp_path, new)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["a.tsv", "plots", "plots/b.png"]
    assert (tmp_path / "a.tsv").read_text() == "old"
    monkeypatch.undo()
    write_files(tmp_path, new)
    assert (tmp_path / "e.md").read_text() == "new" and (tmp_path / "plots/b.png").read_bytes() == b"new"


def test_nan_is_written_as_null_so_the_json_stays_json(tmp_path):
    import json

    write_json(tmp_path / "m.json", {"val": {"loss": 5.0, "loss_se": float("nan")}, "x": [float("inf")]})
    assert json.loads((tmp_path / "m.json").read_text()) == {"val": {"loss": 5.0, "loss_se": None}, "x": [None]}


def test_a_read_only_or_unwritable_target_is_one_line(tmp_path, monkeypatch):
    import os

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "fsync", read_only)
    with pytest.raises(UserError, match=r"writing .*m.json failed: read-only file system; .*run the stage again"):
        write_json(tmp_path / "m.json", {"a": 1})
    assert list(tmp_path.iterdir()) == []
