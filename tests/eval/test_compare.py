"""gdn2 compare on real tiny training runs: the table holds each run's own final numbers, seeds are
summarised, the picture is written, runs of one config at several rates are a sweep whose best rate is
named, and runs that cannot be compared are refused by name."""

import json
import random

import pytest

from gdn2.data_prep.prepare import prepare
from gdn2.data_prep.train_tokenizer import sample_sentences, train_tokenizer
from gdn2.train.loop import NonFiniteLossError, fit
from gdn2.train.metrics import read_jsonl
from gdn2.train.recipe import load_recipe

from gdn2.eval import compare

WORDS = "the a of state gate decay memory token model learns slowly quickly with and or to in".split()


def _data(folder, seed):
    """A prepared data folder (prepare.py) with a tokenizer trained on its own text."""
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 120))) for _ in range(160)]
    folder.mkdir()
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    sentences = sample_sentences([str(folder / "docs.jsonl")], 10_000, None, seed=seed, report=False)
    train_tokenizer(sentences, folder / "tokenizer.model", vocab_size=300, seed=seed)
    prepare([str(folder / "docs.jsonl")], folder / "tokenizer.model", folder, workers=1, val_fraction=0.2,
            progress=False)
    return folder


def _run(tmp_path, data, name, seed, kind, lr=3e-3, **train):
    model = dict(block_size=32, vocab_size=300, n_layer=2, n_embd=32, n_head=2, intermediate_size=64,
                 gdn2_per_layer={"hybrid": 2, "transformer": 0}[kind], sliding_window=16, gdn2_num_heads=2, gdn2_head_dim=16,
                 gdn2_gate_rank=8)
    config = tmp_path / f"{kind}.yaml"  # the config's name is the file's: both hybrid runs share it
    config.write_text(json.dumps({
        "model": model, "train": {"global_batch_size": 4, "micro_batch_size": 4, "max_steps": 6, "warmup_steps": 1,
                                  **train},
        "optimizer": {"lr": lr}, "data": {"train": [str(data)], "val": str(data), "num_workers": 0},
        "eval": {"interval": 3, "num_batches": 2, "length_multipliers": [1, 2]},
        "checkpoint": {"interval": 0, "at_end": False}, "logging": {"interval": 2, "tensorboard": False,
                                                                   "progress_bar": False}}))
    out = tmp_path / "runs" / name
    fit(load_recipe(str(config), {"train.seed": str(seed)}, out_dir=str(out)))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare")
    a, b = _data(tmp / "a", seed=1), _data(tmp / "b", seed=2)
    return {
        "hybrid_1": _run(tmp, a, "hybrid_1", 1, "hybrid"),
        "hybrid_2": _run(tmp, a, "hybrid_2", 2, "hybrid"),
        "transformer_1": _run(tmp, a, "transformer_1", 1, "transformer"),
        "other_tokenizer": _run(tmp, b, "other_tokenizer", 1, "hybrid"),
        "hybrid_slow": _run(tmp, a, "hybrid_slow", 1, "hybrid", lr=3e-4),
        "hybrid_diverged": _diverged(tmp, a),
    }


def _diverged(tmp, data):
    """A run at a rate so high that its loss is not finite at once: the trainer stops it."""
    with pytest.raises(NonFiniteLossError):
        _run(tmp, data, "hybrid_diverged", 1, "hybrid", lr=1e12, grad_clip=None, max_consecutive_nonfinite=0)
    return tmp / "runs" / "hybrid_diverged"


def test_table_holds_each_runs_final_numbers(runs, tmp_path):
    folders = [runs["hybrid_1"], runs["hybrid_2"], runs["transformer_1"]]
    compare.compare(folders, tmp_path / "out", title="tiny")
    table = (tmp_path / "out" / "compare.md").read_text()
    summary = json.loads((tmp_path / "out" / "compare.json").read_text())
    for folder, row in zip(folders, summary):
        records = read_jsonl(folder / "metrics.jsonl")
        train = [r for r in records if r["kind"] == "train"][-1]
        val = [r for r in records if r["kind"] == "val"][-1]
        assert row["final_train_loss"] == train["loss"] and row["tokens"] == train["tokens"] == 6 * 4 * 32
        assert row["final_val_loss"] == {"32": val["val/loss_32"], "64": val["val/loss_64"]}
        line = next(line for line in table.splitlines() if line.startswith(f"| {folder.name} |"))
        for value in (train["loss"], val["val/loss_32"], val["val/loss_64"]):
            assert f" {value:.3f} " in line
    assert summary[2]["block_parameters"] == json.loads((runs["transformer_1"] / "run.json").read_text())[
        "block_parameters"]
    seeds = next(line for line in table.splitlines() if line.startswith("| `hybrid` | `3e-3` | 1, 2 |"))
    losses = [s["final_val_loss"]["32"] for s in summary[:2]]
    assert f"{sum(losses) / 2:.3f} ({max(losses) - min(losses):.3f})" in seeds
    assert (tmp_path / "out" / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_other_tokenizer_and_missing_metrics_are_refused_by_name(runs, tmp_path, capsys):
    assert compare.main([str(runs["hybrid_1"]), str(runs["other_tokenizer"]), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(runs["other_tokenizer"]) in err and "another tokenizer" in err
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "config.yaml").write_text((runs["hybrid_1"] / "config.yaml").read_text())
    assert compare.main([str(runs["hybrid_1"]), str(empty), "--out", str(tmp_path)]) == 2
    assert f"{empty / 'metrics.jsonl'}: missing" in capsys.readouterr().err


def test_a_sweep_names_each_configs_best_rate_from_its_config_yaml(runs, tmp_path):
    """Three rates of the hybrid (one diverged) and one of the transformer: the sweep table holds each rate's
    loss of the seed every rate ran with (seed 1), the best rate is the lowest of those, in bold and named
    per config; the extra seed at 3e-3 leaves the ranking alone; the picture gains the sweep panel."""
    import matplotlib.image

    names = ["hybrid_slow", "hybrid_1", "hybrid_2", "hybrid_diverged", "transformer_1"]
    found = compare.compare([runs[n] for n in names], tmp_path / "out", title="sweep")
    assert [run.lr for run in found] == [3e-4, 3e-3, 3e-3, 1e12, 3e-3]  # optimizer.lr of each config.yaml
    final = {name: [r for r in read_jsonl(runs[name] / "metrics.jsonl") if r["kind"] == "val"][-1]["val/loss_32"]
             for name in ("hybrid_slow", "hybrid_1", "transformer_1")}
    best = "3e-4" if final["hybrid_slow"] < final["hybrid_1"] else "3e-3"
    table = (tmp_path / "out" / "compare.md").read_text()
    row = next(line for line in table.split("## Learning-rate sweep")[1].splitlines() if line.startswith("| `hybrid` |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    assert table.count("| config | lr 3e-4 | lr 3e-3 | lr 1e12 |") == 1
    slow, fast = f"{final['hybrid_slow']:.3f}", f"{final['hybrid_1']:.3f}"
    stopped = read_jsonl(runs["hybrid_diverged"] / "metrics.jsonl")[-1]
    assert stopped["kind"] == "skip"
    assert cells == ([f"**{slow}**", fast] if best == "3e-4" else [slow, f"**{fast}**"]) + [
        f"diverged (step {stopped['step']})"]
    # the lowest rate is at the edge of the sweep: a rate below it might do better
    assert f"| `hybrid` | `{best}` (best of 3){' *' if best == '3e-4' else ''} |" in table
    summary = {r["run"]: r for r in json.loads((tmp_path / "out" / "compare.json").read_text())}
    assert summary["hybrid_diverged"]["diverged"] and summary["hybrid_diverged"]["final_val_loss"] == {}
    assert {n for n, r in summary.items() if r["best_rate"]} == (
        {"hybrid_slow", "transformer_1"} if best == "3e-4" else {"hybrid_1", "hybrid_2", "transformer_1"})
    height, width = matplotlib.image.imread(tmp_path / "out" / "compare.png").shape[:2]
    assert width > 2.5 * height  # three panels: the sweep beside the curves


def test_the_training_length_line_is_inside_the_extrapolation_axis(runs):
    import math

    import matplotlib.pyplot as plt

    loaded = [compare.load_run(runs[name]) for name in ("hybrid_1", "transformer_1")]
    fig = compare.figure(loaded, "tiny")
    try:
        extrapolation = fig.axes[1]
        (line,) = [line for line in extrapolation.get_lines() if line.get_label() == "training length (32 tokens)"]
        assert list(line.get_xdata()) == [32, 32]
        low, high = extrapolation.get_xlim()
        assert math.log2(32 / low) >= 0.4 and math.log2(high / 32) >= 0.4  # well inside, not on an edge
    finally:
        plt.close(fig)
