"""The trainer end to end on CPU with real Fabric: the CLI trains and the loss falls; exact resume;
crash in the middle of a save; SLURM signal -> save -> requeue -> resume; non-finite loss skipping;
wall-clock budget; refusals (other model, used folder)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import gdn2.train.loop as loop
from gdn2.config import Config
from gdn2.model import GPT
from gdn2.checkpoint.consolidate import main as consolidate_main
from gdn2.checkpoint.format import list_checkpoints, read_marker
from gdn2.train.loop import NonFiniteLossError, fit
from gdn2.train.metrics import read_jsonl
from gdn2.train.recipe import load_recipe
from train_helpers import ROOT, micro_config, read_state, run_main


def train_losses(out_dir):
    return {r["step"]: r["loss"] for r in read_jsonl(out_dir / "metrics.jsonl") if r["kind"] == "train"}


def run_fit(cfg, out_dir, resume=None, **overrides):
    recipe = load_recipe(str(cfg), {k: str(v) for k, v in overrides.items()}, out_dir=str(out_dir))
    return fit(recipe, resume=resume)


@pytest.mark.slow
def test_cli_trains_and_the_loss_falls(corpus, tmp_path):
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=24, warmup_steps=2),
                       eval=dict(interval=12, at_end=True), checkpoint=dict(interval=12),
                       logging=dict(tensorboard=True))
    out = tmp_path / "run"
    proc = run_main(["--config", str(cfg), "--out_dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, 25))
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (22, 23, 24)) / 3
    assert last < first - 0.8, (first, last)
    records = read_jsonl(out / "metrics.jsonl")
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in val] == [12, 24]
    assert val[-1]["val/loss_64"] < val[0]["val/loss_64"] and "val/loss_128" in val[-1]  # 1x and 2x lengths
    train = [r for r in records if r["kind"] == "train"]
    assert all(r["tokens_per_sec_per_device"] > 0 and r["lr"] > 0 for r in train)
    assert train[-1]["tokens"] == 24 * 4 * 64
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert load_recipe(str(out / "config.yaml")).train.max_steps == 24  # the resolved config is usable
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [12, 24]

    # consolidation: one model.pt that evaluation can load, outside checkpoint rotation, config beside it
    assert consolidate_main([str(out / "checkpoints")]) == 0
    d = torch.load(out / "final" / "model.pt", weights_only=False)
    assert d["step"] == 24 and (out / "final" / "config.yaml").read_text() == (
        out / "checkpoints" / "step-000000024" / "config.yaml").read_text()
    model = GPT(Config.from_dict(d["config"]))
    model.load_state_dict(d["model"])


@pytest.mark.slow
def test_fused_loss_grouped_projections_and_recompute_train_the_same_run(corpus, tmp_path):
    """``train.fused_loss`` and ``train.grouped_projections`` (on by default) and ``train.recompute``
    (off by default) change how the step computes, not what: the same losses (validation included) and
    weights as the plain path."""
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=4, warmup_steps=1), eval=dict(at_end=True))
    plain = run_fit(cfg, tmp_path / "plain", **{"train.fused_loss": False, "train.grouped_projections": False})
    both = run_fit(cfg, tmp_path / "both", **{"train.recompute": True})
    a, b = train_losses(tmp_path / "plain"), train_losses(tmp_path / "both")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    val = [[v for r in read_jsonl(tmp_path / name / "metrics.jsonl") if r["kind"] == "val"
            for k, v in sorted(r.items()) if k.startswith("val/loss_")] for name in ("plain", "both")]
    assert val[0] and val[1] == pytest.approx(val[0], rel=1e-5)
    wa, wb = read_state(plain.checkpoint)["model"], read_state(both.checkpoint)["model"]
    for k, v in wa.items():
        torch.testing.assert_close(wb[k], v, rtol=1e-4, atol=1e-6)


def test_resume_equals_uninterrupted(corpus, tmp_path):
    """2N steps in one go == N steps, stop, resume, N more: same losses, same data, same weights."""
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=6, warmup_steps=2))
    whole = run_fit(cfg, tmp_path / "whole")
    assert whole.stop_reason == "finished" and whole.step == 6
    first = run_fit(cfg, tmp_path / "split", **{"train.stop_at_step": 3})
    assert first.stop_reason == "stop_at_step" and first.step == 3
    second = run_fit(cfg, tmp_path / "split", resume="auto")
    assert second.step == 6
    a, b = train_losses(tmp_path / "whole"), train_losses(tmp_path / "split")
    assert sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), step
    wa, wb = read_state(whole.checkpoint), read_state(second.checkpoint)
    for k, v in wa["model"].items():
        torch.testing.assert_close(wb["model"][k], v, rtol=1e-6, atol=1e-7)
    ra = torch.load(whole.checkpoint / "ranks" / "rank-00000.pt", weights_only=False)
    rb = torch.load(second.checkpoint / "ranks" / "rank-00000.pt", weights_only=False)
    assert ra["data"] == rb["data"] and ra["data"]["batches_consumed"] == 6 * 2

    # resuming with another model is refused before any work; a changed training knob is allowed
    with pytest.raises(ValueError, match="model config differs.*model.n_layer"):
        run_fit(cfg, tmp_path / "split", resume="auto", **{"model.n_layer": 3})
    with pytest.raises(ValueError, match="train.seed changed"):  # another sample order: nothing to continue
        run_fit(cfg, tmp_path / "split", resume="auto", **{"train.seed": 1})
    longer = run_fit(cfg, tmp_path / "split", resume="auto", **{"train.max_steps": 7})
    assert longer.step == 7
    # a fresh start must not mix with an earlier run's checkpoints
    with pytest.raises(ValueError, match="already holds checkpoints"):
        run_fit(cfg, tmp_path / "split")


def test_checkpoints_record_the_sha256_of_the_tokenizer_the_data_was_made_with(corpus, tmp_path):
    """What consolidation, export, generation and evaluation compare a tokenizer with."""
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    digest = "ab" * 32
    (data / "manifest.json").write_text(json.dumps({"tokenizer": {"vocab_size": 256, "sha256": digest}}))
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=1), data=dict(train=[str(data)], val=str(data)))
    result = run_fit(cfg, tmp_path / "run")
    assert read_marker(result.checkpoint)["tokenizer_sha256"] == digest


# The trainer killed (like kill -9) after writing step 4's data and before its marker.
CRASH_IN_SAVE = """
import os, sys
import gdn2.checkpoint.state as checkpoint
from gdn2.commandline import run
from gdn2.train.cli import main

write_marker = checkpoint.write_marker
def crash(path, marker):
    if marker["step"] == 4:
        os._exit(17)
    write_marker(path, marker)
checkpoint.write_marker = crash
sys.exit(run(main, sys.argv[1:], "pretrain"))
"""


@pytest.mark.slow
def test_crash_mid_save_keeps_the_last_good_checkpoint(corpus, tmp_path):
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=6), checkpoint=dict(interval=2))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", CRASH_IN_SAVE, "--config", str(cfg), "--out_dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 17, proc.stderr[-3000:]  # killed inside the save of step 4
    ckpts = out / "checkpoints"
    assert [s for s, _ in list_checkpoints(ckpts)] == [2]
    assert (ckpts / ".step-000000004.tmp" / "state").exists()  # the model was written, the marker not
    assert not (ckpts / "step-000000004").exists()
    result = run_fit(cfg, out, resume="auto")
    assert result.step == 6
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, 7))  # steps 3-4 of the crashed run were replaced
    assert [s for s, _ in list_checkpoints(ckpts)] == [2, 4, 6]
    assert not list(ckpts.glob(".step-*"))


def _handles_sigusr1(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGUSR1 (Linux: bit 10 of SigCgt in /proc/PID/status)."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) & (1 << (signal.SIGUSR1 - 1)))


@pytest.mark.slow
def test_slurm_signal_during_start_up_saves_requeues_and_resumes(corpus, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "scontrol_args"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{record}"\n')
    scontrol.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "777", "SLURM_JOB_NAME": "pretrain",
           "SLURM_NTASKS": "1", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost", "PYTHONUNBUFFERED": "1"}
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=500))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "pretrain" / "main.py"), "--config", str(cfg), "--out_dir",
                             str(out), "--resume", "auto"], cwd=ROOT, env=dict(os.environ, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # SLURM's warning signal while Python is still starting up (importing torch): as soon as the
        # process handles SIGUSR1, long before its first step. The signal during training is the SLURM
        # cluster test's.
        deadline = time.monotonic() + 60
        while not _handles_sigusr1(proc.pid) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        proc.send_signal(signal.SIGUSR1)
        log, _ = proc.communicate(timeout=300)
        rc = proc.returncode
    finally:
        proc.kill()
    assert rc == 0, log[-3000:]
    assert "SIGUSR1 received during start-up" in log and "step 2/500" not in log
    saved = list_checkpoints(out / "checkpoints")
    assert len(saved) == 1
    step = saved[0][0]
    assert step == 1
    assert record.read_text().split() == ["requeue", "777"]
    assert "job requeued" in log
    # the requeued job: --resume auto picks the checkpoint up
    result = run_fit(cfg, out, resume="auto", **{"train.max_steps": step + 2})
    assert result.step == step + 2
    assert sorted(train_losses(out)) == list(range(1, step + 3))


def nan_loss_at(monkeypatch, steps, accumulation=2):
    """Make the training loss NaN at these optimizer steps (1 = the first of this process)."""
    real, calls = loop.forward_loss, [0]

    def forward_loss(model, batch, chunk_tokens):
        loss = real(model, batch, chunk_tokens)
        if not model.training:
            return loss
        calls[0] += 1
        return loss * float("nan") if (calls[0] - 1) // accumulation + 1 in steps else loss

    monkeypatch.setattr(loop, "forward_loss", forward_loss)


def test_nonfinite_loss_skips_the_step(corpus, tmp_path, monkeypatch):
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=5), checkpoint=dict(interval=1, keep_last=10))
    nan_loss_at(monkeypatch, {3})
    assert run_fit(cfg, tmp_path / "run", **{"train.stop_at_step": 3}).step == 3  # a stop saves right after it
    monkeypatch.undo()
    result = run_fit(cfg, tmp_path / "run", resume="auto")
    assert result.step == 5
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    skips = [r for r in records if r["kind"] == "skip"]
    assert [r["step"] for r in skips] == [3] and skips[0]["loss"] is None  # NaN is written as null
    assert [r["skipped_steps"] for r in records if r["kind"] == "train"] == [0, 0, 1, 1, 1]
    ckpts = dict(list_checkpoints(tmp_path / "run" / "checkpoints"))
    s2, s3, s4 = (read_state(ckpts[i]) for i in (2, 3, 4))
    for k in s2["model"]:  # the skipped step changed neither weights nor optimizer moments
        assert torch.equal(s2["model"][k], s3["model"][k]), k
    for i, st in s2["optimizer"]["state"].items():
        assert torch.equal(st["exp_avg"], s3["optimizer"]["state"][i]["exp_avg"])
    assert any(not torch.equal(s3["model"][k], s4["model"][k]) for k in s3["model"])  # training went on
    assert all(torch.isfinite(v).all() for v in s4["model"].values())
    assert s4["trainer"]["skipped_steps"] == 1


def test_too_many_nonfinite_steps_stop_with_a_clear_error(corpus, tmp_path, monkeypatch):
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=8, max_consecutive_nonfinite=2),
                       checkpoint=dict(interval=2))
    nan_loss_at(monkeypatch, {3, 4, 5, 6})
    with pytest.raises(NonFiniteLossError, match=r"3 optimizer steps in a row.*step-000000002"):
        run_fit(cfg, tmp_path / "run")
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2]  # the last good one


def test_ctrl_c_saves_stops_and_says_how_to_continue(corpus, tmp_path, monkeypatch, caplog):
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=50))
    real, calls = loop.forward_loss, [0]

    def interrupted_at_the_third_micro_batch(model, batch, chunk_tokens):
        calls[0] += 1
        if calls[0] == 3:  # inside step 2: the next step carries every rank's vote, then the run saves and stops
            os.kill(os.getpid(), signal.SIGINT)
        return real(model, batch, chunk_tokens)

    monkeypatch.setattr(loop, "forward_loss", interrupted_at_the_third_micro_batch)
    with caplog.at_level("INFO", logger="gdn2"):
        result = run_fit(cfg, tmp_path / "run")
    assert result.stop_reason == "interrupted" and result.step == 3 and read_marker(result.checkpoint)["step"] == 3
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopped at step")]
    assert summary == [f"stopped at step 3 (interrupted); saved {result.checkpoint}: the same command with "
                       "--resume auto continues from it"]


@pytest.mark.slow
def test_wall_clock_budget_saves_and_exits(corpus, tmp_path):
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=1000, max_wall_time="4"))
    started = time.time()
    result = run_fit(cfg, tmp_path / "run")
    assert result.stop_reason == "wall_time" and 1 <= result.step < 1000
    assert time.time() - started < 60
    assert read_marker(result.checkpoint)["step"] == result.step
