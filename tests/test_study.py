"""The quality study (gdn2 study, launched by scripts/quality_study.sh) on the built-in corpus with two tiny
configs and two rates, every run a real trainer process: the sweep table and picture come from the runs,
an override after -- wins over the study's own setting, the extra seed trains at the best rate only,
NIAH is scored on the best-rate runs, and a rerun trains and scores nothing again."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gdn2.data_prep.default_corpus import build_default_corpus
from gdn2.study import main

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "quality_study.sh"
MODELS = ["swa_gdn2_tiny", "transformer_tiny"]


def _study(data, out, *options, overrides=()):
    """scripts/quality_study.sh DATA OUT with the tiny preset: 3 steps of 2 x 256 tokens, one validation."""
    command = [str(SCRIPT), str(data), str(out), "--lrs", "1e-3 3e-3", "--steps", "3", "--batch", "2",
               "--micro_batch", "2", "--evals", "1", "--tasks", "", *options,
               "--", "--data.num_workers", "0", "--logging.tensorboard", "false", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _final_val(run, length=256):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "val"][-1][f"val/loss_{length}"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The built-in corpus, small: 300 KB of the standard library, a 512-piece tokenizer."""
    folder = tmp_path_factory.mktemp("study") / "default"
    build_default_corpus(folder, vocab_size=512, max_bytes=300_000, workers=1, val_fraction=0.1,
                         shard_tokens=50_000, progress=False)
    return folder


def test_help_exits_0_with_the_usage_only():
    done = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("usage: gdn2 study DATA OUT") and "--lrs" in done.stdout


def test_overrides_of_the_studys_own_options_are_refused_by_name():
    with pytest.raises(ValueError, match=r"--optimizer\.lr after --: the study sets it from --lrs"):
        main(["data", "out", "--", "--optimizer.lr", "1e-3"])


@pytest.mark.slow
def test_sweep_then_seeds_then_niah_and_a_rerun_does_nothing_again(data, tmp_path, capsys):
    out = tmp_path / "study"
    # 1. the sweep: two configs at two rates, seed 7; the script validates on the whole set unless told
    _study(data, out, "--models", " ".join(MODELS), "--seeds", "7", overrides=["--eval.num_batches", "2"])
    sweep = {(m, lr): out / f"{m}_lr{lr}_seed7" for m in MODELS for lr in ("1e-3", "3e-3")}
    assert sorted(p.name for p in out.iterdir()) == sorted(["compare"] + [p.name for p in sweep.values()])
    for (model, lr), run in sweep.items():
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["optimizer"]["lr"] == float(lr) and config["train"]["seed"] == 7
        assert config["eval"]["num_batches"] == 2  # the override after --, not the study's 100000
        assert config["eval"]["length_multipliers"] == [1, 2, 4]  # the study's own setting
    table = (out / "compare" / "compare.md").read_text()
    rows = table.split("## Learning-rate sweep")[1].split("## Runs")[0]
    best = {}
    for model in MODELS:
        losses = {lr: _final_val(sweep[(model, lr)]) for lr in ("1e-3", "3e-3")}
        best[model] = min(losses, key=losses.get)
        cells = [f"**{v:.3f}**" if lr == best[model] else f"{v:.3f}" for lr, v in losses.items()]
        assert f"| `{model}` | {cells[0]} | {cells[1]} |" in rows
        assert f"| `{model}` | `{best[model]}` (best of 2) * |" in table
    assert (out / "compare" / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # what is left: the extra seed at the best rate of each config
    assert main([str(data), str(out), "--models", " ".join(MODELS), "--lrs", "1e-3 3e-3", "--seeds", "7 8",
                 "--steps", "3", "--batch", "2", "--dry_run"]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [f"{m}_lr{best[m]}_seed8: new" for m in MODELS]

    # 2. a second seed and NIAH for one config: its sweep is read, not trained again
    model = "transformer_tiny"
    stamps = {run: (run / "metrics.jsonl").stat().st_mtime_ns for run in sweep.values()}
    niah = ["--niah", "512", "--niah_samples", "1", "--niah_haystack", str(data / "corpus.jsonl")]
    log = _study(data, out, "--models", model, "--seeds", "7 8", *niah)
    assert {run: (run / "metrics.jsonl").stat().st_mtime_ns for run in sweep.values()} == stamps
    assert log.count("finished earlier, not trained again") == 2
    seeded = out / f"{model}_lr{best[model]}_seed8"
    assert sorted(p.name for p in out.glob("*_seed8")) == [seeded.name]
    assert yaml.safe_load((seeded / "config.yaml").read_text())["optimizer"]["lr"] == float(best[model])
    scored = [out / f"{model}_lr{best[model]}_seed{seed}" / "eval" / "results-step-000000003.json" for seed in (7, 8)]
    assert all(path.is_file() for path in scored)
    assert not (sweep[(model, "1e-3" if best[model] == "3e-3" else "3e-3")] / "eval").exists()
    niah_table = (out / "compare" / "compare.md").read_text().split("## Long-context retrieval")[1]
    assert all(f"| {path.parents[1].name} |" in niah_table for path in scored)

    # 3. the same command again: nothing trained, nothing scored
    stamps = {path: path.stat().st_mtime_ns for path in scored}
    log = _study(data, out, "--models", model, "--seeds", "7 8", *niah)
    assert "training:" not in log and log.count("NIAH scored earlier, not again") == 2
    assert {path: path.stat().st_mtime_ns for path in scored} == stamps
    assert "the study is complete: 3 runs" in log
