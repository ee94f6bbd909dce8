"""A rank that dies or hangs in a run of two CPU ranks (Fabric starts rank 1 as a child of rank 0, as
``python -m gdn2 pretrain --distributed.devices 2`` does): the surviving rank leaves within the collective
timeout plus the stated bound (``gdn2.train.peers.timings``), and the run's stderr holds exactly one error
line, naming the failed rank (its pid and host) and the checkpoint ``--resume auto`` will take, and no
traceback. Four ranks with FSDP2 hybrid sharding find a stopped rank at the run's timeout too. A killed
rank 0 is reported by rank 1. A rank's own error is the run's only line, and the other rank leaves
quietly."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from gdn2.checkpoint.format import list_checkpoints
from gdn2.train.metrics import read_jsonl
from gdn2.train.peers import EXIT_PEER_FAILURE, timings
from train_helpers import ROOT, micro_config

TIMEOUT = 10  # distributed.timeout_seconds: how long a collective waits for a stopped rank
LOAD_SLACK = 15  # seconds allowed on top of the stated bound on a loaded two-core machine
ERROR_LINE = re.compile(r"\berror\b", re.IGNORECASE)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _gone(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _steps(run) -> int:
    try:
        return max((r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"), default=0)
    except (OSError, ValueError):
        return 0


class Ranks:
    """``pretrain/main.py`` on ``n`` CPU ranks; stdout and stderr in files."""

    def __init__(self, cfg, tmp_path, n: int = 2, *extra: str) -> None:
        self.run = tmp_path / "run"
        self.out, self.err = tmp_path / "stdout", tmp_path / "stderr"
        self._files = [open(self.out, "w"), open(self.err, "w")]
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "pretrain" / "main.py"), "--config", str(cfg), "--out_dir", str(self.run),
             "--distributed.devices", str(n), "--distributed.accelerator", "cpu", "--train.micro_batch_size", "1",
             "--distributed.timeout_seconds", str(TIMEOUT), *extra],
            cwd=ROOT, stdout=self._files[0], stderr=self._files[1], env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def wait_training(self, steps: int, timeout: float = 240) -> list[int]:
        """The pids of ranks 1, 2, ... (Fabric starts them in order), once the run has trained ``steps``
        steps and saved a checkpoint."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.err.read_text()[-3000:]
            if _steps(self.run) >= steps and list_checkpoints(self.run / "checkpoints"):
                return sorted(_children(self.proc.pid))
            time.sleep(0.2)
        raise AssertionError(f"no training within {timeout} s:\n{self.err.read_text()[-3000:]}")

    def stop(self) -> None:
        for pid in [self.proc.pid, *_children(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        for f in self._files:
            f.close()


def _wait_gone(pids, timeout: float) -> float:
    """Seconds until every one of ``pids`` has exited (AssertionError after ``timeout``)."""
    start = time.monotonic()
    while not all(_gone(p) for p in pids):
        left = [p for p in pids if not _gone(p)]
        assert time.monotonic() - start < timeout, f"still running after {timeout} s: {left}"
        time.sleep(0.05)
    return time.monotonic() - start


def _the_one_line(stderr: str) -> str:
    assert "Traceback" not in stderr and "Exception raised from" not in stderr, stderr[-4000:]
    errors = [line for line in stderr.splitlines() if ERROR_LINE.search(line)]
    assert len(errors) == 1, stderr[-4000:]
    return errors[0]


@pytest.fixture
def cfg(corpus, tmp_path):
    return micro_config(corpus, tmp_path, train=dict(max_steps=100_000, warmup_steps=1),
                        checkpoint=dict(interval=3, keep_last=5))


BOUND = timings(TIMEOUT).bound


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_rank_that_dies_or_hangs_ends_the_run_with_one_line(cfg, tmp_path, how):
    run = Ranks(cfg, tmp_path)
    try:
        (rank1,) = run.wait_training(steps=4)
        os.kill(rank1, getattr(signal, how))
        took = _wait_gone([run.proc.pid], TIMEOUT + BOUND + LOAD_SLACK)
        # the dead rank's connections close at once; the stopped one is found when the collective times out
        if how == "SIGKILL":
            assert took < BOUND + LOAD_SLACK
        else:
            assert took > TIMEOUT - 1
        assert _wait_gone([rank1], 10) < 10  # the stopped rank was ended too: the run is over
    finally:
        run.stop()
    assert run.proc.returncode == EXIT_PEER_FAILURE
    line = _the_one_line(run.err.read_text())
    newest = list_checkpoints(run.run / "checkpoints")[-1][1]
    assert line.startswith(f"gdn2 pretrain: error: rank 1 (pid {rank1} on {socket.gethostname()}) ")
    assert line.endswith(f"--resume auto will continue from {newest}")
    if how == "SIGKILL":
        assert "was killed by SIGKILL" in line
    else:
        assert "stopped answering (no heartbeat" in line


@pytest.mark.slow
def test_a_stopped_rank_under_hybrid_sharding_is_found_at_the_runs_timeout(cfg, tmp_path):
    """Four ranks, FSDP2 sharded in two groups of two and replicated across them (as across two nodes):
    the device mesh's own process groups wait the run's timeout too (torch would give them 30 minutes)."""
    run = Ranks(cfg, tmp_path, 4, "--distributed.strategy", "fsdp2", "--distributed.sharding", "hybrid",
                "--distributed.replicas", "2")
    try:
        ranks = run.wait_training(steps=4)
        assert len(ranks) == 3
        os.kill(ranks[-1], signal.SIGSTOP)  # rank 3
        took = _wait_gone([run.proc.pid, *ranks], TIMEOUT + BOUND + LOAD_SLACK)
        assert took > TIMEOUT - 1
    finally:
        run.stop()
    assert run.proc.returncode == EXIT_PEER_FAILURE
    line = _the_one_line(run.err.read_text())
    assert line.startswith(f"gdn2 pretrain: error: rank 3 (pid {ranks[-1]} on {socket.gethostname()}) stopped "
                           "answering (no heartbeat") and "; the 3 other ranks stopped." in line


@pytest.mark.slow
def test_rank_0_killed_rank_1_reports_it(cfg, tmp_path):
    """Rank 0's process serves the job's key-value store: rank 1 finds it gone, says so, and leaves."""
    run = Ranks(cfg, tmp_path)
    try:
        (rank1,) = run.wait_training(steps=4)
        rank0 = run.proc.pid
        os.kill(rank0, signal.SIGKILL)
        run.proc.wait()
        assert _wait_gone([rank1], TIMEOUT + BOUND + LOAD_SLACK) < timings(TIMEOUT).store + BOUND + LOAD_SLACK
    finally:
        run.stop()
    line = _the_one_line(run.err.read_text())
    newest = list_checkpoints(run.run / "checkpoints")[-1][1]
    assert line.startswith(f"gdn2 pretrain: error: rank 0 (pid {rank0} on {socket.gethostname()}) stopped "
                           "answering (the job's key-value store it serves is gone)")
    assert line.endswith(f"--resume auto will continue from {newest}")


@pytest.mark.slow
def test_an_error_on_rank_0_alone_is_the_only_line(corpus, tmp_path):
    """Rank 0 alone builds a missing default corpus (a mistyped folder is an error) while rank 1 waits at a
    barrier: rank 0's one line is all the run prints; rank 1 takes note and leaves without a traceback."""
    cfg = micro_config(corpus, tmp_path, data=dict(train=[str(tmp_path / "dta")], val=str(tmp_path / "dta"),
                                                   prepare_default=True))
    run = Ranks(cfg, tmp_path)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while run.proc.poll() is None and time.monotonic() < deadline:
            seen.update(_children(run.proc.pid))
            time.sleep(0.05)
        assert run.proc.wait(timeout=1) == 2
        assert seen and _wait_gone(seen, 30) < 30  # rank 1 left too
    finally:
        run.stop()
    line = _the_one_line(run.err.read_text())
    assert line.startswith("gdn2 pretrain: error: data.train / data.val: ") and "dta holds no train_*.bin" in line
