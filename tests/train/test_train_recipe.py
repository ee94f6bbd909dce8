"""Recipe loading, CLI parsing and validation: every error names the key, before any work starts."""

from pathlib import Path

import pytest
import yaml

from gdn2.commandline import run
from gdn2.train import cli
from gdn2.train.recipe import load_recipe, make_plan, parse_text_value


def test_reference_recipe_of_the_1_3B_configs():
    for name in ("gdn2_1.3B", "swa_gdn2_1.3B"):
        r = load_recipe(name)
        assert r.optimizer.lr == 4e-4 and r.optimizer.betas == [0.9, 0.95] and r.optimizer.eps == 1e-8
        assert r.optimizer.weight_decay == 0.1 and not r.optimizer.decay_all
        assert r.train.grad_clip == 1.0 and r.train.seed == 3407
        plan = make_plan(r, world_size=8)
        assert plan.tokens_per_step == 128 * 4096 == 524_288
        assert plan.grad_accum_steps == 128 // (4 * 8)
        assert plan.max_steps == -(-100_000_000_000 // 524_288)
        assert plan.warmup_steps == round(0.01 * plan.max_steps)
        assert plan.min_lr == pytest.approx(4e-5)


def test_overrides_are_typed():
    r = load_recipe("swa_gdn2_tiny", {"train.max_steps": "12", "optimizer.lr": "1e-3", "train.grad_clip": "null",
                                      "eval.length_multipliers": "[1, 3]", "data.train": "some/dir",
                                      "train.activation_checkpointing": "true", "model.n_layer": "2",
                                      "train.max_tokens": "2e6"})
    assert r.train.max_steps == 12 and r.optimizer.lr == 1e-3 and r.train.grad_clip is None
    assert r.eval.length_multipliers == [1, 3] and r.train.activation_checkpointing is True
    assert r.model.n_layer == 2 and r.train.max_tokens == 2_000_000
    assert [s.path for s in r.train_sources()] == ["some/dir"]


def test_collective_timeout_in_seconds_overrides_the_minutes():
    assert load_recipe("swa_gdn2_tiny").distributed.collective_timeout == 30 * 60
    assert load_recipe("swa_gdn2_tiny", {"distributed.timeout_minutes": "2"}).distributed.collective_timeout == 120
    assert load_recipe("swa_gdn2_tiny", {"distributed.timeout_minutes": "2", "distributed.timeout_seconds": "15"}
                       ).distributed.collective_timeout == 15


@pytest.mark.parametrize("overrides, key", [
    ({"train.lr": "1"}, "--train.lr"),
    ({"trian.max_steps": "1"}, "--trian.max_steps"),
    ({"train.max_steps": "ten"}, "--train.max_steps"),
    ({"optimizer.lr": "fast"}, "--optimizer.lr"),
    ({"train.activation_checkpointing": "maybe"}, "--train.activation_checkpointing"),
    ({"model.n_layers": "2"}, "--model.n_layers"),
    ({"optimizer.lr": "-1"}, "optimizer.lr"),
    ({"optimizer.betas": "[0.9]"}, "optimizer.betas"),
    ({"distributed.precision": "fp8"}, "distributed.precision"),
    ({"checkpoint.keep_last": "0"}, "checkpoint.keep_last"),
    ({"train.max_wall_time": "soon"}, "train.max_wall_time"),
    ({"data.train": "[{path: a, weight: -1}]"}, "data.train[0].weight"),
    ({"data.train": "[{path: a, wieght: 1}]"}, "wieght"),
    ({"distributed.timeout_seconds": "5"}, "distributed.timeout_seconds"),
    ({"distributed.timeout_seconds": "soon"}, "--distributed.timeout_seconds"),
])
def test_bad_overrides_name_the_key(overrides, key):
    with pytest.raises((ValueError, TypeError), match=key.replace("[", r"\[").replace("]", r"\]")):
        load_recipe("swa_gdn2_tiny", overrides)


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    data = yaml.safe_load(open(Path(__file__).resolve().parents[2] / "configs" / "swa_gdn2_tiny.yaml"))
    data["train"]["learning_rate"] = 1.0
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="train: unknown key.*learning_rate"):
        load_recipe(str(p))
    data["train"].pop("learning_rate")
    data["trainer"] = {}
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="unknown section.*trainer"):
        load_recipe(str(p))


def test_yaml_numbers_written_as_text_are_numbers(tmp_path):
    data = yaml.safe_load(open(Path(__file__).resolve().parents[2] / "configs" / "swa_gdn2_tiny.yaml"))
    data["optimizer"]["lr"] = "4e-4"  # PyYAML reads 4e-4 (no dot) as a string
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    assert load_recipe(str(p)).optimizer.lr == 4e-4


def test_batch_layout_must_divide():
    r = load_recipe("swa_gdn2_1.3B")
    with pytest.raises(ValueError, match="train.global_batch_size"):
        make_plan(r, world_size=3)
    assert make_plan(r, world_size=32).grad_accum_steps == 1


def test_resolved_config_round_trips_as_a_config_file(tmp_path):
    r = load_recipe("swa_gdn2_tiny", {"optimizer.lr": "1e-3"})
    p = tmp_path / "resolved.yaml"
    p.write_text(r.to_yaml())
    again = load_recipe(str(p))
    assert again.sections_dict() == r.sections_dict() | {"model": again.model.to_dict()}
    assert again.model.to_dict() | {"name": r.model.name} == r.model.to_dict()


def test_parse_text_value_lists_and_nulls():
    from typing import Optional
    assert parse_text_value("null", Optional[int], "k") is None
    assert parse_text_value("[1, 2]", list[int], "k") == [1, 2]
    assert parse_text_value("7", list[int], "k") == [7]
    assert parse_text_value("1e9", int, "k") == 1_000_000_000
    with pytest.raises(ValueError, match="k"):
        parse_text_value("1.5", int, "k")


def test_cli_help_lists_every_option(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    from gdn2.train.recipe import SECTIONS, section_fields
    for section in SECTIONS:
        for key in section_fields(section):
            assert f"--{section}.{key} (" in out
    assert "default: 3407" in out and "--resume" in out and "--out_dir" in out
    assert cli.main(["--config", "swa_gdn2_tiny", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--train.max_steps (int | null, default: 400)" in out
    # a null default says what it stands for
    assert "--eval.micro_batch_size (int | null, default: null, meaning train.micro_batch_size = 4)" in out
    assert "--optimizer.fused (bool | null, default: null, meaning true on CUDA, false on CPU)" in out


@pytest.mark.parametrize("argv, needle", [
    (["--config", "swa_gdn2_tiny", "--train.lr", "1"], "--train.lr"),
    (["--config", "swa_gdn2_tiny", "--train.max_steps", "x"], "--train.max_steps"),
    (["--config", "no_such_config"], "no_such_config"),
    (["--config", "swa_gdn2_tiny", "--bogus", "1"], "--bogus"),
    (["--config", "swa_gdn2_tiny", "stray"], "stray"),
    (["--train.max_steps", "1"], "--config is required"),
])
def test_cli_errors_exit_2_naming_the_problem(argv, needle, capsys):
    assert run(cli.main, argv, "pretrain") == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
