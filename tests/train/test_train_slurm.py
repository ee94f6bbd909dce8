"""SLURM environment parsing, topology resolution, requeue through a fake scontrol, stop signals."""

import os
import signal
import stat

import pytest

from gdn2.train.slurm import SlurmJob, StopSignals, parse_duration, requeue, resolve_topology

SRUN_ENV = {
    "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "pretrain", "SLURM_NTASKS": "16", "SLURM_NNODES": "2",
    "SLURM_NTASKS_PER_NODE": "8", "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
}


def test_parse_srun_environment():
    job = SlurmJob.from_env(SRUN_ENV)
    assert job is not None
    assert (job.num_nodes, job.num_tasks, job.tasks_per_node) == (2, 16, 8)
    assert (job.global_rank, job.local_rank, job.node_rank) == (9, 1, 1)
    assert job.requeue_id == "4242"
    compressed = dict(SRUN_ENV, SLURM_TASKS_PER_NODE="8(x2)")
    del compressed["SLURM_NTASKS_PER_NODE"]
    assert SlurmJob.from_env(compressed).tasks_per_node == 8
    array = dict(SRUN_ENV, SLURM_ARRAY_JOB_ID="4200", SLURM_ARRAY_TASK_ID="3")
    assert SlurmJob.from_env(array).requeue_id == "4200_3"


def test_not_a_slurm_task():
    assert SlurmJob.from_env({}) is None
    assert SlurmJob.from_env({"SLURM_JOB_ID": "1"}) is None  # salloc shell, no srun
    assert SlurmJob.from_env(dict(SRUN_ENV, SLURM_JOB_NAME="bash")) is None


def test_topology_from_slurm_torchrun_and_flags():
    assert resolve_topology(None, None, SRUN_ENV) == resolve_topology(8, 2, SRUN_ENV)
    topo = resolve_topology(None, None, SRUN_ENV)
    assert (topo.devices, topo.num_nodes, topo.launcher) == (8, 2, "slurm")
    with pytest.raises(ValueError, match="does not match the 16 SLURM tasks"):
        resolve_topology(4, None, SRUN_ENV)
    topo = resolve_topology(None, None, {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})
    assert (topo.devices, topo.num_nodes, topo.launcher) == (4, 1, "torchrun")
    topo = resolve_topology(None, None, {})
    assert (topo.devices, topo.num_nodes, topo.launcher) == ("auto", 1, "local")


@pytest.mark.parametrize("text, seconds", [("90", 90), ("1:30", 90), ("02:00:00", 7200), ("1-00:00:00", 86400),
                                           ("1-2", 93600), ("0.5", 0.5)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "0", "-5", "1:2:3:4"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def fake_scontrol(folder, exit_code=0):
    record = folder / "scontrol_args"
    exe = folder / "scontrol"
    exe.write_text(f'#!/bin/sh\necho "$@" >> "{record}"\nexit {exit_code}\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe, record


def test_requeue_calls_scontrol_with_the_job_id(tmp_path, monkeypatch):
    exe, record = fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert requeue(SlurmJob.from_env(SRUN_ENV)) is True
    assert record.read_text().split() == ["requeue", "4242"]


def test_requeue_failure_is_reported_not_raised(tmp_path, caplog):
    exe, record = fake_scontrol(tmp_path, exit_code=1)
    assert requeue(SlurmJob.from_env(SRUN_ENV), scontrol=str(exe)) is False
    assert "failed" in caplog.text
    assert requeue(SlurmJob.from_env(SRUN_ENV), scontrol=str(tmp_path / "missing")) is False


def test_stop_signals_set_a_flag_and_restore():
    before = signal.getsignal(signal.SIGUSR1)
    sig = StopSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert sig.received == "SIGUSR1" and sig.requeue_wanted
        os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C asks for a clean stop
        assert sig.received == "SIGINT" and not sig.requeue_wanted
        with pytest.raises(KeyboardInterrupt):  # the second one interrupts
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        sig.restore()
    assert signal.getsignal(signal.SIGUSR1) == before
