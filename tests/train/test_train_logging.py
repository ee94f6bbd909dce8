"""What a run reports: CSV and Weights & Biases (offline) beside JSONL and TensorBoard, a profiler trace
on request, log lines that never break the progress bar, settings that do not apply as written."""

import csv
import io
import json
import logging
import re
import sys

import pytest

from gdn2.train.loop import fit
from gdn2.train.metrics import read_jsonl
from gdn2.train.recipe import load_recipe
from train_helpers import micro_config


def run_fit(cfg, out_dir, **overrides):
    return fit(load_recipe(str(cfg), {k: str(v) for k, v in overrides.items()}, out_dir=str(out_dir)))


@pytest.mark.slow
def test_csv_wandb_offline_and_a_profiler_trace(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=4, profile_steps="2-3"),
                       eval=dict(interval=2, at_end=False),
                       logging=dict(interval=1, csv=True, wandb=True, wandb_mode="offline", tensorboard=True))
    out = tmp_path / "run"
    run_fit(cfg, out)
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    with open(out / "csv" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert [float(r["train/loss"]) for r in rows] == [r["loss"] for r in train]
    (run,) = (out / "wandb" / "wandb").glob("offline-run-*")
    (records,) = run.glob("run-*.wandb")
    assert (out / "wandb" / "run_id").read_text().strip() in run.name
    assert b"train/loss" in records.read_bytes()  # the metrics reached the run
    (trace,) = (out / "profile").glob("steps-2-3.rank0.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_log_lines_never_break_the_progress_bar_and_adjusted_settings_are_said(corpus, tmp_path, monkeypatch,
                                                                             caplog):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=3, warmup_steps=20),
                       logging=dict(interval=1, progress_bar=True))
    with caplog.at_level(logging.INFO, logger="gdn2"):
        run_fit(cfg, tmp_path / "run")
    shown = terminal.getvalue()
    assert "step/s" in shown or "s/step" in shown  # the bar was drawn
    pieces = re.split(r"[\r\n]", shown)
    logged = [p for p in pieces if " INFO " in p]
    assert logged and all(re.match(r"^\d\d:\d\d:\d\d INFO ", p) for p in logged)  # each on a line of its own
    messages = [r.getMessage() for r in caplog.records]
    assert any("train.compile: true fuses with torch.compile on CUDA only" in m for m in messages)
    assert any("train.warmup_steps: 20 capped at the run's 3 optimizer steps" in m for m in messages)
    assert any(m.startswith("outputs: run folder") and "metrics.jsonl" in m and "checkpoints" in m for m in messages)
