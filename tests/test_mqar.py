"""gdn2 mqar: the data (answers, ranges, no replacement, queries, seed, power-law gaps), the state sizes,
the mixer table, one-line errors, the outputs and their reuse, and (slow) the CPU preset's wiring check."""

import json
import math

import pytest
import torch

from gdn2.__main__ import main
from gdn2.mqar import (IGNORE, MIXERS, MQARModel, Shape, gap_log_weights, make_batch, model_config, sample_gaps,
                       state_floats)

VOCAB = 8192
# a sweep of seconds: width 32, 3 steps of 2 sequences of 16 and 32 tokens, vocabulary 64
TINY = ["--widths", "32", "--steps", "3", "--batch_size", "2", "--train_shapes", "16:2,32:4",
        "--test_shapes", "16:2,32:8", "--test_examples", "4", "--vocab_size", "64", "--window", "8"]


def _check_row(seq: list[int], labels: list[int], shape: Shape, vocab: int) -> None:
    n, half = shape.pairs, vocab // 2
    keys, values = seq[0:2 * n:2], seq[1:2 * n:2]
    assert all(0 <= k < half for k in keys) and all(half <= v < vocab for v in values)
    assert len(set(keys)) == n and len(set(values)) == n  # no replacement within a sequence
    value_of = dict(zip(keys, values))
    asked = [p for p, y in enumerate(labels) if y != IGNORE]
    assert len(asked) == n  # one query per key
    assert sorted(seq[p] for p in asked) == sorted(keys)  # each key asked once
    for p in asked:
        assert p >= 2 * n and (p - 2 * n) % 2 == 0  # a query slot after the pairs
        assert labels[p] == value_of[seq[p]] and seq[p + 1] == labels[p]  # its value, as in its pair
    used = set(range(2 * n)) | set(asked) | {p + 1 for p in asked}
    filler = [seq[p] for p in range(shape.length) if p not in used]
    assert not set(filler) & set(keys)  # a key appears only in its pair and its query
    assert all(0 <= t < vocab for t in filler)


@pytest.mark.parametrize("shape", [Shape(64, 4), Shape(128, 8), Shape(256, 64), Shape(1024, 256), Shape(67, 5)])
def test_every_answer_is_the_value_paired_with_its_key(shape):
    seq, labels = make_batch(shape, 8, seed=3, vocab_size=VOCAB)
    assert seq.shape == labels.shape == (8, shape.length) and seq.dtype == labels.dtype == torch.int64
    for row in range(8):
        _check_row(seq[row].tolist(), labels[row].tolist(), shape, VOCAB)


def test_small_vocabulary_rows():
    # few keys and values: no-replacement and the filler's key exclusion are tight here
    shape = Shape(40, 10)
    seq, labels = make_batch(shape, 16, seed=0, vocab_size=24)
    for row in range(16):
        _check_row(seq[row].tolist(), labels[row].tolist(), shape, 24)


def test_deterministic_from_the_seed():
    a = make_batch(Shape(128, 8), 4, seed=11)
    b = make_batch(Shape(128, 8), 4, seed=11)
    c = make_batch(Shape(128, 8), 4, seed=12)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_gaps_follow_the_power_law():
    # one draw per row is an exact sample of p(g) ~ a g^(a-1): compare frequencies bucket by bucket
    slots, rows = 200, 40000
    gaps = sample_gaps(rows, slots, 1, 0.01, torch.Generator().manual_seed(0))[:, 0]
    assert int(gaps.min()) >= 1 and int(gaps.max()) <= slots
    p = gap_log_weights(slots, 0.01).exp()
    p = p / p.sum()
    for lo, hi in [(1, 1), (2, 2), (3, 4), (5, 16), (17, 64), (65, 200)]:
        expected = float(p[lo - 1:hi].sum())
        seen = float(((gaps >= lo) & (gaps <= hi)).double().mean())
        assert abs(seen - expected) < 4 * math.sqrt(expected * (1 - expected) / rows) + 1e-3, (lo, hi, seen, expected)
    # short gaps are more likely than long ones, per gap
    counts = torch.bincount(gaps, minlength=slots + 1)[1:].double()
    assert counts[0] > counts[1] > counts[4:8].mean() > counts[100:].mean()
    # without replacement: distinct gaps in a row; in whole sequences, queries crowd the slots near the pairs
    many = sample_gaps(500, slots, 50, 0.01, torch.Generator().manual_seed(1))
    assert all(len(set(r)) == 50 for r in many.tolist())
    seq, labels = make_batch(Shape(1024, 16), 200, seed=5)
    slot = ((labels != IGNORE).nonzero()[:, 1] - 32) // 2 + 1
    assert float((slot <= 16).double().mean()) > float((slot > 400).double().mean()) > 0


def test_state_floats():
    width = 64
    gdn2, swa, full = (model_config(m, width, VOCAB, 1024, 64) for m in ("gdn2", "swa", "attention"))
    per_gdn2_layer = 2 * 32 * 32 + 3 * (2 * 64 + 64)  # 2 heads of 32 x 32, conv tails of q | k | v
    assert state_floats(gdn2, 64) == state_floats(gdn2, 1024) == 2 * per_gdn2_layer
    assert state_floats(full, 256) == 2 * (2 * 256 * 2 * 32)  # keys and values of every position
    assert state_floats(swa, 32) == 2 * (2 * 32 * 64) and state_floats(swa, 1024) == state_floats(swa, 64)


def test_every_row_of_the_mixer_table_runs():
    for name in MIXERS:
        config = model_config(name, 32, 64, 32, 8)
        model = MQARModel(config)
        seq, labels = make_batch(Shape(32, 4), 2, seed=0, vocab_size=64)
        loss, correct, count = model(seq, labels)
        assert loss.ndim == 0 and torch.isfinite(loss) and int(count) == 8 and 0 <= int(correct) <= 8, name


def _one_line_error(capsys, argv, *needles):
    assert main(["mqar", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


def test_bad_input_is_one_line_naming_the_flag(capsys, tmp_path):
    out = ["--out", str(tmp_path / "never")]
    _one_line_error(capsys, ["--mixers", "gdn2,mamba", *out], "--mixers", "mamba")
    _one_line_error(capsys, ["--widths", "0", *out], "--widths", "positive")
    _one_line_error(capsys, ["--widths", "-64", *out], "--widths")
    _one_line_error(capsys, ["--widths", "48", *out], "--widths", "multiple of 32")
    _one_line_error(capsys, ["--test_shapes", "64:4,64:32", *out], "--test_shapes", "too short for 32 pairs")
    _one_line_error(capsys, ["--train-shapes", "64", *out], "--train_shapes", "LENGTH:PAIRS")
    _one_line_error(capsys, ["--steps", "0", *out], "--steps")
    _one_line_error(capsys, ["--lrs", "1e-3,fast", *out], "--lrs")
    _one_line_error(capsys, ["--device", "tpu", *out], "--device")
    _one_line_error(capsys, ["--vocab_size", "16", *out], "--test_shapes", "256:16 has more pairs than the 8 keys")
    (tmp_path / "file").write_text("")
    _one_line_error(capsys, ["--out", str(tmp_path / "file")], "--out", "not a folder")
    assert not (tmp_path / "never").exists()


def test_outputs_are_consistent_and_a_rerun_skips_finished_runs(capsys, tmp_path):
    out = tmp_path / "mqar"
    argv = ["mqar", *TINY, "--mixers", "gdn2,swa,attention", "--lrs", "1e-3,3e-3", "--out", str(out)]
    assert main(argv) == 0
    first = capsys.readouterr().out
    data = json.loads((out / "mqar.json").read_text())
    assert len(data["runs"]) == 6 and (out / "mqar.png").stat().st_size > 0
    best = {b["mixer"]: b for b in data["summary"]["best"]}
    assert set(best) == {"gdn2", "swa", "attention"}
    table = (out / "mqar.md").read_text()
    for mixer, b in best.items():
        run = next(r for r in data["runs"] if (r["mixer"], r["lr"]) == (mixer, b["lr"]))
        assert b["mean_accuracy"] == max(r["mean_accuracy"] for r in data["runs"] if r["mixer"] == mixer)
        assert set(run["accuracy"]) == {"16:2", "32:8"} and run["steps_done"] == 3
        cells = [f"{run['accuracy'][t]:.3f}" for t in ("16:2", "32:8")]
        assert f"| {mixer} | 32 | {b['lr']:g} | " in table and " | ".join(cells) in table
    assert best["gdn2"]["state_floats"]["16:2"] == best["gdn2"]["state_floats"]["32:8"]
    assert best["attention"]["state_floats"]["32:8"] == 2 * best["attention"]["state_floats"]["16:2"]
    assert first.count("steps in") == 6

    # the same settings again: nothing trained, the record kept as it was
    assert main(argv) == 0
    again = capsys.readouterr().out
    assert again.count("recorded, skipped") == 6
    assert json.loads((out / "mqar.json").read_text())["runs"] == data["runs"]

    # one more rate: only its runs are trained; other settings are recorded beside, not reported
    assert main(argv[:-6] + ["--mixers", "attention", "--lrs", "1e-3,1e-2", "--out", str(out)]) == 0
    more = capsys.readouterr().out
    assert more.count("recorded, skipped") == 1 and more.count("steps in") == 1
    assert main(["mqar", *TINY, "--mixers", "attention", "--lrs", "1e-3", "--seed", "1", "--out", str(out)]) == 0
    capsys.readouterr()
    data = json.loads((out / "mqar.json").read_text())
    assert len(data["runs"]) == 8 and len(data["summary"]["best"]) == 1
    assert "7 recorded run(s) with other settings" in (out / "mqar.md").read_text()


@pytest.mark.slow
def test_cpu_preset_attention_recalls(tmp_path, capsys):
    # the check that data, masking and scoring are wired, on the mixer that needs no GDN-2 oracle time:
    # the CPU preset's own attention runs (600 x 16 sequences), then 1000 x 64, where it passes 0.5
    out = tmp_path / "cpu"
    assert main(["mqar", "--preset", "cpu", "--mixers", "attention", "--out", str(out)]) == 0
    best = json.loads((out / "mqar.json").read_text())["summary"]["best"]
    assert [b["mixer"] for b in best] == ["attention"]
    assert best[0]["accuracy"]["64:4"] > 0.02  # chance: 1 / 4096 = 0.00024
    assert main(["mqar", "--preset", "cpu", "--mixers", "attention", "--lrs", "3e-3", "--steps", "1000",
                 "--batch_size", "64", "--test_shapes", "64:4,128:8", "--out", str(out)]) == 0
    capsys.readouterr()
    best = json.loads((out / "mqar.json").read_text())["summary"]["best"]
    assert best[0]["accuracy"]["64:4"] > 0.5
