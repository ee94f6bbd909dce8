"""gdn2/eval/harness.py: lm-eval tasks offline through the task manager that knows gdn2's folder, on a checkpoint
and on a live model, also inside training (logged scores equal an evaluation of the saved weights)."""

import numpy as np
import pytest
import yaml

from gdn2.data.shards import write_shard
from gdn2.checkpoint.load import load_model
from gdn2.eval.harness import evaluate_model
from gdn2.eval.results import summarize
from gdn2.train.loop import fit
from gdn2.train.metrics import read_jsonl
from gdn2.train.recipe import load_recipe


def test_lm_eval_during_training_matches_saved_weights(artifacts, tmp_path):
    folder, tok, cfg = artifacts
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    write_shard(data / "train_0000000000.bin", rng.integers(3, tok.vocab_size, 20_000).astype(np.uint16))
    write_shard(data / "val_0000000000.bin", rng.integers(3, tok.vocab_size, 2_000).astype(np.uint16))
    (data / "tokenizer.model").write_bytes((folder / "tokenizer.model").read_bytes())
    model = dict(cfg.to_dict())
    model.pop("name")
    recipe_yaml = {
        "model": model,
        "train": dict(global_batch_size=2, micro_batch_size=2, max_steps=2, warmup_steps=1),
        "data": dict(train=[str(data)], val=None, num_workers=0),
        "eval": dict(interval=0, at_end=False),
        "lm_eval": dict(interval=2, tasks=["gdn2_local_mc"], limit=4, batch_size=2),
        "checkpoint": dict(interval=0, at_end=True, state_dict_type="full"),
        "logging": dict(interval=1, progress_bar=False, tensorboard=False),
    }
    path = tmp_path / "hook.yaml"
    path.write_text(yaml.safe_dump(recipe_yaml))
    result = fit(load_recipe(str(path), out_dir=str(tmp_path / "run")))
    logged = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "lm_eval"]
    assert [r["step"] for r in logged] == [2]
    acc = logged[0]["lm_eval/gdn2_local_mc/acc"]
    assert 0.0 <= acc <= 1.0

    loaded = load_model(result.checkpoint, device="cpu", dtype="float32")
    again = evaluate_model(loaded.model, tok, ["gdn2_local_mc"], limit=4, batch_size=2)
    assert again["gdn2_local_mc/acc"] == pytest.approx(acc)


def test_lm_eval_section_is_validated(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"model": {"n_layer": 1}, "lm_eval": {"interval": 5, "tasks": []}}))
    with pytest.raises(ValueError, match="lm_eval.tasks"):
        load_recipe(str(path))
    path.write_text(yaml.safe_dump({"model": {"n_layer": 1}, "lm_eval": {"limit": 2.5}}))
    with pytest.raises(ValueError, match="lm_eval.limit"):
        load_recipe(str(path))


def test_simple_evaluate_runs_local_tasks_offline(artifacts):
    import lm_eval

    from gdn2.eval.harness import make_task_manager

    folder, _, _ = artifacts
    tasks = ["gdn2_local"]
    results = lm_eval.simple_evaluate(model="gdn2", model_args=f"checkpoint={folder / 'model.pt'},dtype=float32",
                                      tasks=tasks, limit=4, batch_size=4, device="cpu", bootstrap_iters=0,
                                      task_manager=make_task_manager(tasks))
    summary = summarize(results)
    for key in ("gdn2_local_mc/acc", "gdn2_local_mc/acc_norm", "gdn2_local_lambada/acc",
                "gdn2_local_lambada/perplexity", "gdn2_local_ppl/word_perplexity", "gdn2_local_ppl/bits_per_byte",
                "gdn2_local_gen/exact_match,strip"):
        assert key in summary and summary[key] == summary[key], key  # present and not NaN
    assert 1.0 < summary["gdn2_local_ppl/word_perplexity"]
    assert results["n-samples"]["gdn2_local_mc"]["effective"] == 4


def test_importing_the_adapter_patches_nothing_and_the_task_manager_knows_local_tasks():
    """Importing gdn2's lm-eval modules leaves lm-eval as it was (a plain TaskManager does not know the
    local tasks); the task manager made with gdn2's folder on its include path does."""
    from lm_eval.tasks import TaskManager

    import gdn2.eval.harness  # noqa: F401
    from gdn2.eval.harness import LOCAL_TASKS, make_task_manager

    assert not {"gdn2_local", "gdn2_local_mc"} & set(TaskManager(include_defaults=False).all_tasks)
    assert {"gdn2_local", "gdn2_local_mc"} <= set(make_task_manager(["gdn2_local"]).all_tasks)
    assert (LOCAL_TASKS / "gdn2_local" / "gdn2_local.yaml").is_file()


def test_evaluate_model_in_process(artifacts, caplog):
    folder, tok, cfg = artifacts
    model = load_model(folder / "model.pt", device="cpu", dtype="float32").model.train()
    with caplog.at_level("WARNING"):
        scores = evaluate_model(model, tok, ["gdn2_local_lambada"], limit=3, batch_size=2)
    assert set(scores) == {"gdn2_local_lambada/acc", "gdn2_local_lambada/perplexity"}
    assert model.training  # given back in the mode it came in
    assert "Custom kwargs" not in caplog.text  # lm-eval's advice about task kwargs our tasks do not take
