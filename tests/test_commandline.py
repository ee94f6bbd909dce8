"""Every command line turns an expected failure into one line naming the file, argument or key, exit 2,
and shows the traceback only with --debug."""

import json
import subprocess
import sys

import pytest
import torch

from gdn2.__main__ import main
from gdn2.files import file_sha256

MICRO = "model: {block_size: 64, vocab_size: 256, n_layer: 2, n_embd: 64, n_head: 2, intermediate_size: 128}\n"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from gdn2.data_prep.train_tokenizer import train_tokenizer

    return train_tokenizer([f"some words number {i} of text" for i in range(300)],
                           tmp_path_factory.mktemp("tok") / "t.model", vocab_size=300)


def one_line_error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0] == err.splitlines()[-1] and "Traceback" not in err, err
    err = errors[0]
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def test_pretrain_config_errors(capsys, tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  n_layer: [1\n")
    one_line_error(capsys, ["pretrain", "--config", str(bad_yaml)], "bad.yaml: not valid YAML at line")
    listed = tmp_path / "listed.yaml"
    listed.write_text("model: [1, 2]\n")
    one_line_error(capsys, ["pretrain", "--config", str(listed)], "model: expected a mapping")
    micro = tmp_path / "micro.yaml"
    micro.write_text(MICRO)
    one_line_error(capsys, ["pretrain", "--config", str(micro), "--model.norm_eps", "-1"], "model.norm_eps must be positive")
    one_line_error(capsys, ["pretrain", "--config", str(micro), "--model.gdn2_head_dim", "512"], "model.gdn2_head_dim")
    one_line_error(capsys, ["pretrain", "--config", str(micro), "--data.train", str(tmp_path / "nothing"), "--out_dir",
                            str(tmp_path / "run")], "nothing")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_prepare_and_tokenizer_input_errors(capsys, tmp_path, tokenizer):
    (tmp_path / "notes.csv").write_text("a,b\n")
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"id": 3}\n')
    (tmp_path / "not_a.model").write_bytes(b"junk")
    out = str(tmp_path / "out")
    one_line_error(capsys, ["prepare", "--input", str(tmp_path / "none*.jsonl"), "--tokenizer", str(tokenizer),
                            "--output", out], "--input: no files match")
    one_line_error(capsys, ["prepare", "--input", str(tmp_path / "notes.csv"), "--tokenizer", str(tokenizer),
                            "--output", out], "notes.csv: unsupported input type")
    one_line_error(capsys, ["prepare", "--input", str(tmp_path / "empty.jsonl"), "--tokenizer",
                            str(tmp_path / "missing.model"), "--output", out], "missing.model does not exist")
    one_line_error(capsys, ["prepare", "--input", str(tmp_path / "empty.jsonl"), "--tokenizer",
                            str(tmp_path / "not_a.model"), "--output", out], "not_a.model: not a SentencePiece model")
    one_line_error(capsys, ["tokenizer", "--input", str(tmp_path / "notes.csv"), "--output", str(tmp_path / "t.model")],
                   "notes.csv: unsupported input type")
    one_line_error(capsys, ["tokenizer", "--input", str(tmp_path / "empty.jsonl"), "--output",
                            str(tmp_path / "t.model")], "--input: no text found")


def test_no_documents_exit_non_zero(capsys, tmp_path, tokenizer):
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"id": 3}\n')
    one_line_error(capsys, ["prepare", "--input", str(tmp_path / "empty.jsonl"), "--tokenizer", str(tokenizer),
                            "--output", str(tmp_path / "out")], "no usable document", "2 read")
    assert not list((tmp_path / "out").glob("*.bin")) and not (tmp_path / "out" / "manifest.json").exists()


def test_consolidate_and_eval_errors(capsys, tmp_path):
    one_line_error(capsys, ["consolidate", str(tmp_path / "nope")], "nope does not exist")
    (tmp_path / "empty_run").mkdir()
    one_line_error(capsys, ["consolidate", str(tmp_path / "empty_run")], "no complete checkpoint")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    one_line_error(capsys, ["eval", "--checkpoint", str(tmp_path / "junk.pt"), "--tasks", "gdn2_local"],
                   "junk.pt", "could not be read")
    one_line_error(capsys, ["compare", str(tmp_path / "empty_run"), "--out", str(tmp_path / "c")],
                   "empty_run/config.yaml: missing")


def test_values_are_literal_text_unless_they_start_a_list_or_mapping(tmp_path):
    """A path with '#' is that path (YAML read it as 'data/set' and a comment, and the run trained on another
    folder); '[...]' and '{...}' are still YAML flow lists and mappings."""
    from gdn2.train.recipe import load_recipe

    micro = tmp_path / "micro.yaml"
    micro.write_text(MICRO)
    recipe = load_recipe(str(micro), {"data.train": "data/set #2", "eval.length_multipliers": "3"})
    assert recipe.data.train == ["data/set #2"] and recipe.eval.length_multipliers == [3]
    recipe = load_recipe(str(micro), {"data.train": "[a, 'set #2']", "eval.length_multipliers": "[1, 2]"})
    assert recipe.data.train == ["a", "set #2"] and recipe.eval.length_multipliers == [1, 2]
    assert load_recipe(str(micro), {"data.train": "{path: x, weight: 2}"}).data.train == [{"path": "x", "weight": 2}]


def test_generate_eval_and_export_refuse_a_tokenizer_other_than_the_runs(capsys, tmp_path, artifacts, tokenizer):
    """Another tokenizer turns every id into another piece without an error: refused where the checkpoint
    records its own (an explicit --allow_tokenizer_mismatch accepts it; tests/checkpoint/test_load.py)."""
    folder, _, _ = artifacts
    blob = torch.load(folder / "model.pt", weights_only=True)
    blob["tokenizer_sha256"] = file_sha256(folder / "tokenizer.model")
    (tmp_path / "m").mkdir()
    torch.save(blob, tmp_path / "m" / "model.pt")
    model = str(tmp_path / "m" / "model.pt")
    for argv in (["generate", "--checkpoint", model, "--prompt", "x"],
                 ["eval", "--checkpoint", model, "--tasks", "gdn2_local"],
                 ["hf", "export", "--checkpoint", model, "--out", str(tmp_path / "hf")]):
        one_line_error(capsys, argv + ["--tokenizer", str(tokenizer)], f"tokenizer '{tokenizer}'",
                       "is not the one checkpoint", "--allow_tokenizer_mismatch")
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_debug_shows_the_traceback_and_the_process_exits_2(tmp_path):
    argv = [sys.executable, "-m", "gdn2", "consolidate", str(tmp_path / "nope")]
    plain = subprocess.run(argv, capture_output=True, text=True)
    assert plain.returncode == 2 and plain.stderr.startswith("gdn2 consolidate: error:")
    debug = subprocess.run(argv + ["--debug"], capture_output=True, text=True)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_unknown_command(capsys):
    assert main(["train"]) == 2
    assert "unknown command 'train'" in capsys.readouterr().err


def test_an_error_every_rank_raises_is_printed_by_rank_zero_alone(capsys):
    from gdn2.commandline import run, told_elsewhere

    for rank in (0, 1):
        def failing(argv, rank=rank):
            raise told_elsewhere(ValueError("the same on every rank"), elsewhere=rank != 0)

        assert run(failing, [], prog="gdn2 pretrain") == 2
        assert capsys.readouterr().err == ("gdn2 pretrain: error: the same on every rank (--debug shows the "
                                           "traceback)\n" if rank == 0 else "")
