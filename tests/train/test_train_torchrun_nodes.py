"""Two torchrun "nodes" on one machine: two torchrun processes (``--nnodes=2``, one rank each) meet through
a c10d rendezvous on 127.0.0.1, the second one in a UTS namespace of its own (its own host name) where the
machine allows it, and train ``pretrain/main.py`` with FSDP2 hybrid sharding across them (gloo on
loopback): every step's loss is the one of one process with the same global batch."""

import os
import socket
import shutil
import subprocess
import sys

import pytest

from gdn2.train.loop import fit
from gdn2.train.metrics import read_jsonl
from gdn2.train.recipe import load_recipe
from train_helpers import ROOT, micro_config


def _losses(folder):
    return {r["step"]: r["loss"] for r in read_jsonl(folder / "metrics.jsonl") if r["kind"] == "train"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _own_uts_namespace() -> bool:
    """Whether this process may run a command in a new UTS namespace (root, unshare present)."""
    if not shutil.which("unshare"):
        return False
    try:
        return subprocess.run(["unshare", "--uts", "--", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
def test_two_torchrun_nodes_match_one_process(corpus, tmp_path):
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=6, warmup_steps=1))
    assert fit(load_recipe(str(cfg), out_dir=str(tmp_path / "one"))).step == 6
    one = _losses(tmp_path / "one")

    port, out = _free_port(), tmp_path / "two"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=gdn2-two-nodes",
                "--local_addr=127.0.0.1", "--max_restarts=0"]
    train = [str(ROOT / "pretrain" / "main.py"), "--config", str(cfg), "--out_dir", str(out),
             "--distributed.accelerator", "cpu", "--distributed.strategy", "fsdp2",
             "--train.micro_batch_size", "1", "--distributed.timeout_seconds", "120"]
    # the node names do not resolve on this machine: gloo binds to loopback
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    # c10d hands out the node ranks in the order the nodes arrive; --node_rank only names our two commands
    first = torchrun + ["--node_rank=0", "--rdzv_conf=is_host=1"] + train
    second = torchrun + ["--node_rank=1", "--rdzv_conf=is_host=0"] + train
    if _own_uts_namespace():
        second = ["unshare", "--uts", "--", "sh", "-c", 'hostname gdn2-node-b && exec "$@"', "sh", *second]
    logs = [open(tmp_path / f"node{i}.log", "w") for i in range(2)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
             for cmd, log in zip((first, second), logs)]
    try:
        codes = [p.wait(timeout=420) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n".join((tmp_path / f"node{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], text[-4000:]
    assert "2 rank(s) on cpu (ModelParallelStrategy" in text
    two = _losses(out)
    assert sorted(two) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert two[step] == pytest.approx(one[step], rel=1e-5), step
