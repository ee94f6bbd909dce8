"""Helpers of the tests that submit jobs to the SLURM cluster of .ci/slurm_cluster.sh."""

import subprocess
import time


def job_state(job: str) -> str:
    """The job's state as the controller reports it (it keeps finished jobs for a few minutes)."""
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    found = [w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")]
    return found[0] if found else "GONE"


def wait_for(what, condition, timeout, log):
    """Poll ``condition`` until it holds; AssertionError naming ``what`` with the job log's tail after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; job log:\n{log.read_text()[-4000:] if log.exists() else ''}")
