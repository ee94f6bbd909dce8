"""gdn2/checkpoint/load.py: a checkpoint's weights, config and tokenizer found for inference."""

import shutil

import torch

from gdn2.checkpoint.load import load_model
from gdn2.model import GPT


def test_checkpoint_folder_with_run_config_and_bare_state_dict(artifacts, tmp_path):
    folder, _, cfg = artifacts
    run = tmp_path / "run"
    (run / "step-00100").mkdir(parents=True)
    state = torch.load(folder / "model.pt", weights_only=True)["model"]
    torch.save({f"_orig_mod.{k}": v for k, v in state.items()}, run / "step-00100" / "model.pt")
    import yaml

    (run / "config.yaml").write_text(yaml.safe_dump({"model": cfg.to_dict(), "train": {"lr": 4e-4}}))
    shutil.copy(folder / "tokenizer.model", run / "tokenizer.model")
    loaded = load_model(run / "step-00100", device="cpu")
    assert loaded.config == cfg and loaded.checkpoint == run / "step-00100" / "model.pt"
    ref = GPT(cfg)
    ref.load_state_dict(state)
    assert torch.equal(loaded.model.lm_head.weight, ref.lm_head.weight)
