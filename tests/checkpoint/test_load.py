"""gdn2/checkpoint/load.py: a checkpoint's weights, config and tokenizer found for inference."""

import json
import shutil

import pytest
import torch

from gdn2.checkpoint.load import load_model
from gdn2.files import file_sha256
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


def test_the_runs_tokenizer_is_required_where_its_sha256_is_recorded(artifacts, tmp_path):
    """A tokenizer of the same size but not the run's turns every id into another piece without an error:
    refused when the checkpoint records its digest, or when the run's run.json does (checkpoints written
    before checkpoints recorded it); accepted with allow_tokenizer_mismatch."""
    import sentencepiece as spm

    from tiny_checkpoint import training_text

    folder, tok, _ = artifacts
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text() * 2), model_prefix=str(tmp_path / "other"), vocab_size=tok.vocab_size,
        model_type="bpe", byte_fallback=False, normalization_rule_name="identity", unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, minloglevel=2, num_threads=1)
    other = tmp_path / "other.model"
    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    blob = torch.load(folder / "model.pt", weights_only=True)
    torch.save(dict(blob, tokenizer_sha256=file_sha256(folder / "tokenizer.model")), final / "model.pt")
    shutil.copy(other, final / "tokenizer.model")  # the wrong one beside it
    for given in (None, other):
        with pytest.raises(ValueError, match=r"(other|final/tokenizer)\.model' \(sha256 \w+\.\.\.\) is not the one "
                                             r"checkpoint .* was trained with \(sha256 \w+\.\.\., recorded in "
                                             r".*final/model.pt\)"):
            load_model(final / "model.pt", tokenizer=given, device="cpu")
    assert load_model(final / "model.pt", tokenizer=folder / "tokenizer.model", device="cpu").tokenizer.vocab_size \
        == tok.vocab_size
    assert load_model(final / "model.pt", device="cpu", allow_tokenizer_mismatch=True).tokenizer.path == \
        final / "tokenizer.model"

    torch.save(blob, final / "model.pt")  # no digest of its own: the run's run.json records it
    (final.parent / "run.json").write_text(json.dumps(
        {"data": {"train": [{"path": "data", "tokenizer_sha256": file_sha256(folder / "tokenizer.model")}]}}))
    with pytest.raises(ValueError, match=r"is not the one checkpoint .* recorded in .*run/run.json"):
        load_model(final / "model.pt", device="cpu")
