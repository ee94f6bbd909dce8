"""gdn2/files.py: folder locks between real processes, atomic writes of a file or a whole folder, and what a
writer killed outright leaves behind."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from gdn2.files import FolderLock, atomic_file, atomic_folder

HOLD = ("import sys, time\nfrom gdn2.files import FolderLock\n"
        "lock = FolderLock(sys.argv[1], '.job.lock')\nassert lock.acquire() is None\nprint('held', flush=True)\n"
        "time.sleep(600)\n")


def test_a_folder_lock_refuses_a_second_holder_naming_it_and_is_free_once_the_holder_is_killed(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        lock = FolderLock(tmp_path, ".job.lock")
        refusal = lock.acquire()
        assert refusal is not None and refusal.startswith(f"pid {holder.pid} on {socket.gethostname()} since ")
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it, its description left in the file
        holder.wait()
    assert lock.acquire() is None  # the kernel let go with the process
    assert lock.holder().startswith(f"pid {os.getpid()} on ")
    waiting = subprocess.run([sys.executable, "-c", "import sys\nfrom gdn2.files import FolderLock\n"
                              "print(FolderLock(sys.argv[1], '.job.lock').acquire())", str(tmp_path)],
                             capture_output=True, text=True)
    assert waiting.stdout.startswith(f"pid {os.getpid()} on ")  # refused while this process holds it
    lock.release()


def test_two_atomic_writers_of_one_file_each_deliver_a_whole_file(tmp_path):
    path = tmp_path / "corpus.jsonl"
    with atomic_file(path) as first:
        first.write("first " * 1000)
        with atomic_file(path) as second:  # a second writer of the same file, while the first writes
            second.write("second " * 1000)
        assert path.read_text() == "second " * 1000
        first.write("end")
    assert path.read_text() == "first " * 1000 + "end"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]  # no temporary file left


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
