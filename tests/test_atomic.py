from __future__ import annotations

import errno
import io
import re

import pytest

from gpt2.core.atomic import atomic_dir, atomic_file, write_json
from gpt2.core.errors import UserError
from gpt2.core.progress import Progress


def test_disk_full_is_explained_and_leaves_nothing(tmp_path):
    with pytest.raises(UserError, match="disk full while writing .*out; free some space"):
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "a.bin").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_replaces_old_output_only_on_success(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "out") as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("crash")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["old.txt"]
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new.txt"]


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
