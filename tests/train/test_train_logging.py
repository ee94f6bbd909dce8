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


def run_fit(cfg, out_dir, resume=None, **overrides):
    return fit(load_recipe(str(cfg), {k: str(v) for k, v in overrides.items()}, out_dir=str(out_dir)), resume=resume)


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
    (run,) = (out / "wandb").glob("offline-run-*")  # where the README says
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


def _csv_rows(out):
    """The CSV's rows without the timing columns (which no two runs share)."""
    timing = ("train/tokens_per_sec_per_device", "train/step_time")
    with open(out / "csv" / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if k not in timing} for row in csv.DictReader(f)]


def test_resumed_runs_keep_every_log_record_and_continue_the_open_interval(corpus, tmp_path):
    """Stopped twice inside a logging interval and resumed: the CSV and the JSONL hold the records of an
    uninterrupted run, the first interval after each resume averaged over all of its steps."""
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=6, warmup_steps=2),
                       eval=dict(interval=3, at_end=False), logging=dict(interval=2, csv=True))
    run_fit(cfg, tmp_path / "whole")
    run_fit(cfg, tmp_path / "split", **{"train.stop_at_step": 3})
    run_fit(cfg, tmp_path / "split", resume="auto", **{"train.stop_at_step": 5})
    run_fit(cfg, tmp_path / "split", resume="auto")
    whole, split = _csv_rows(tmp_path / "whole"), _csv_rows(tmp_path / "split")
    assert [int(r["step"]) for r in whole if r["train/loss"]] == [2, 4, 6]
    assert [int(r["step"]) for r in whole if r["val/loss_64"]] == [3, 6]
    assert split == whole
    records = [[{k: v for k, v in r.items() if k not in ("tokens_per_sec_per_device", "step_time")}
                for r in read_jsonl(tmp_path / name / "metrics.jsonl")] for name in ("whole", "split")]
    assert records[1] == records[0]
