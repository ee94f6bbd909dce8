"""lm-eval tasks run inside training: logged scores equal an evaluation of the saved weights."""

import numpy as np
import pytest
import yaml

from gdn2.data.shards import write_shard
from gdn2.checkpoint.load import load_model
from gdn2.eval.harness import evaluate_model
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
