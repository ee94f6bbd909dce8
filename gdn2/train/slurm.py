"""Cluster glue: SLURM / torchrun topology, stop signals, requeueing, wall-clock budgets.

Under SLURM the job script asks for ``--signal=USR1@120``: two minutes before the time limit every task
gets SIGUSR1. The trainer then finishes its current optimizer step, saves a checkpoint and (rank 0)
runs ``scontrol requeue``; the requeued job starts with ``--resume auto`` and continues from that
checkpoint. SIGTERM (preemption) is handled the same way.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number of seconds, ``MM:SS``, ``HH:MM:SS`` or ``D-HH:MM:SS`` (SLURM's form).

    Raises ValueError for anything else or a non-positive duration.
    """
    s = str(text).strip()
    try:
        seconds = float(s)
    except ValueError:
        m = re.fullmatch(r"(?:(\d+)-)?(\d+(?::\d+){0,2})", s)
        if not m:
            raise ValueError(f"cannot read a duration from {text!r}; use seconds, 'HH:MM:SS' or 'D-HH:MM:SS'") from None
        days = int(m.group(1) or 0)
        parts = [int(p) for p in m.group(2).split(":")]
        if len(parts) == 1 and m.group(1):
            parts = [parts[0], 0, 0]  # "D-HH"
        while len(parts) < 3:
            parts.insert(0, 0)
        h, mi, se = parts
        seconds = days * 86400 + h * 3600 + mi * 60 + se
    if not seconds > 0:
        raise ValueError(f"duration must be positive, got {text!r}")
    return float(seconds)


def _first_int(text: Optional[str]) -> Optional[int]:
    """``"8(x2),4"`` -> 8: SLURM's compressed per-node task lists start with the first node's count."""
    if not text:
        return None
    m = re.match(r"\s*(\d+)", text)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class SlurmJob:
    """The SLURM variables of a task started by ``srun`` (or ``sbatch`` with one task)."""

    job_id: str
    array_job_id: Optional[str]
    array_task_id: Optional[str]
    num_nodes: int
    num_tasks: int
    tasks_per_node: int
    global_rank: int
    local_rank: int
    node_rank: int

    @property
    def requeue_id(self) -> str:
        """The id ``scontrol requeue`` wants: ``<array job>_<task>`` for array jobs."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Optional["SlurmJob"]:
        """The job this process belongs to, or None when it was not started as a SLURM task.

        Mirrors Lightning's detection: ``SLURM_NTASKS`` set and the job is not an interactive shell
        (``salloc`` then ``python ...`` without ``srun``).
        """
        if "SLURM_JOB_ID" not in env or "SLURM_NTASKS" not in env:
            return None
        if env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
            return None
        num_tasks = int(env["SLURM_NTASKS"])
        num_nodes = int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
        per_node = (_first_int(env.get("SLURM_NTASKS_PER_NODE")) or _first_int(env.get("SLURM_TASKS_PER_NODE"))
                    or max(1, num_tasks // num_nodes))
        return cls(
            job_id=env["SLURM_JOB_ID"],
            array_job_id=env.get("SLURM_ARRAY_JOB_ID"),
            array_task_id=env.get("SLURM_ARRAY_TASK_ID"),
            num_nodes=num_nodes,
            num_tasks=num_tasks,
            tasks_per_node=per_node,
            global_rank=int(env.get("SLURM_PROCID", 0)),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            node_rank=int(env.get("SLURM_NODEID", 0)),
        )


def requeue(job: SlurmJob, scontrol: Optional[str] = None) -> bool:
    """Run ``scontrol requeue <id>``; True on success. Failures are logged, never raised: the
    checkpoint is already safe, and a failed requeue must not turn a clean exit into a crash."""
    exe = scontrol or shutil.which("scontrol")
    if exe is None:
        log.error("scontrol not found on PATH; job %s is not requeued", job.requeue_id)
        return False
    try:
        result = subprocess.run([exe, "requeue", job.requeue_id], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.error("scontrol requeue %s failed: %s", job.requeue_id, e)
        return False
    if result.returncode != 0:
        log.error("scontrol requeue %s failed (exit %d): %s", job.requeue_id, result.returncode,
                  result.stderr.strip())
        return False
    log.info("requeued SLURM job %s", job.requeue_id)
    return True


@dataclass(frozen=True)
class Topology:
    devices: int | str  # per node; "auto" lets Fabric count the GPUs
    num_nodes: int
    launcher: str  # "slurm", "torchrun" or "local"


def resolve_topology(devices: Optional[int], num_nodes: Optional[int], env: Mapping[str, str] = os.environ
                     ) -> Topology:
    """Devices per node and node count: explicit values win, then SLURM, then torchrun, then local.

    Raises ValueError when explicit values contradict the launcher's task count.
    """
    job = SlurmJob.from_env(env)
    if job is not None:
        d = devices if devices is not None else job.tasks_per_node
        n = num_nodes if num_nodes is not None else job.num_nodes
        if d * n != job.num_tasks:
            raise ValueError(
                f"distributed.devices ({d}) x distributed.num_nodes ({n}) = {d * n} does not match the "
                f"{job.num_tasks} SLURM tasks (srun starts one task per device: --ntasks-per-node = GPUs per node)")
        return Topology(d, n, "slurm")
    if "LOCAL_WORLD_SIZE" in env and "WORLD_SIZE" in env:
        local, world = int(env["LOCAL_WORLD_SIZE"]), int(env["WORLD_SIZE"])
        d = devices if devices is not None else local
        n = num_nodes if num_nodes is not None else max(1, world // local)
        if d * n != world:
            raise ValueError(f"distributed.devices ({d}) x distributed.num_nodes ({n}) does not match "
                             f"torchrun's WORLD_SIZE={world}")
        return Topology(d, n, "torchrun")
    return Topology(devices if devices is not None else "auto", num_nodes or 1, "local")


_early: list[str] = []  # SIGUSR1 / SIGTERM received before StopSignals was installed


def _record_early(signum: int, frame) -> None:
    _early.append(signal.Signals(signum).name)


def catch_early_signals() -> None:
    """Record SIGUSR1 and SIGTERM from the first line of the pretrain command on, instead of dying of
    them: a SLURM warning or a preemption that comes while Python imports torch and the trainer sets up
    is answered at the first step (a save, and a requeue under SLURM) once :class:`StopSignals` is
    installed. Light: imports nothing beyond the standard library."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name in ("SIGUSR1", "SIGTERM"):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, _record_early)


class StopSignals:
    """Turns SIGUSR1 / SIGTERM / SIGINT into a flag the training loop polls once per step.

    The handler only records the signal: the loop decides, at a step boundary and in agreement with
    every rank, to save and stop. A second SIGINT raises KeyboardInterrupt as usual.
    """

    HANDLED = ("SIGUSR1", "SIGTERM", "SIGINT")

    def __init__(self) -> None:
        self.received: Optional[str] = None
        self._previous: dict[int, object] = {}

    def install(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set from the main thread
        for name in self.HANDLED:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.signal(sig, self._handle)
        if _early and self.received is None:
            self.received = _early[-1]  # came during start-up: answered at the first step
            log.info("%s received during start-up: the run saves and stops after its first step", self.received)
        _early.clear()
        return self

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.received == "SIGINT":
            raise KeyboardInterrupt
        self.received = name

    @property
    def requeue_wanted(self) -> bool:
        """SLURM's warning (USR1) and preemption (TERM) call for a requeue; Ctrl-C does not."""
        return self.received in ("SIGUSR1", "SIGTERM")

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
