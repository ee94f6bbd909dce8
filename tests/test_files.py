"""gdn2/files.py: a folder written whole, and what a writer killed outright leaves behind."""

import subprocess
import sys

import pytest

from gdn2.files import atomic_folder


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_writers_leftovers_are_cleared_and_a_folder_it_had_set_aside_comes_back(tmp_path):
    """Killed between setting the old folder aside and moving the new one in (where the file system cannot
    swap folders): the next write puts the old folder back and removes the half-written one."""
    target = tmp_path / "final"
    pid = dead_pid()
    (tmp_path / f".final.old-{pid}-1a2b" / "final").mkdir(parents=True)
    (tmp_path / f".final.old-{pid}-1a2b" / "final" / "model.pt").write_text("the last good model")
    (tmp_path / f".final.tmp-{pid}-3c4d").mkdir()
    (tmp_path / f".final.tmp-{pid}-3c4d" / "model.pt").write_text("half")
    with pytest.raises(RuntimeError):
        with atomic_folder(target) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".final.tmp-")
            raise RuntimeError("this write fails too")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert (target / "model.pt").read_text() == "the last good model"
    with atomic_folder(target) as tmp:
        (tmp / "model.pt").write_text("the new model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert [p.read_text() for p in target.iterdir()] == ["the new model"]
