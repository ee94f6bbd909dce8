"""A tiny checkpoint shared by the evaluation, checkpoint and tokenizer tests: a real SentencePiece tokenizer
trained on a small text and a random-init hybrid model (GDN-2 layer + sliding-window attention layer)
saved as a consolidated model.pt beside it."""

import json
from pathlib import Path

import torch

from gdn2.config import Config
from gdn2.model import GPT

ROOT = Path(__file__).resolve().parents[1]
TASK_DATA = ROOT / "eval" / "tasks" / "gdn2_local" / "data"
MAX_LENGTH = 48  # block_size of the test model: short, so rolling windows and truncation happen


def training_text() -> list[str]:
    lines = []
    for name, keys in (("ppl.jsonl", ["text"]), ("lambada.jsonl", ["text"]), ("mc.jsonl", ["question", "choices"]),
                       ("gen.jsonl", ["prompt", "answer"])):
        for row in map(json.loads, (TASK_DATA / name).read_text().splitlines()):
            lines.append(" ".join(" ".join(row[k]) if isinstance(row[k], list) else row[k] for k in keys))
    return lines


def make_tiny_checkpoint(folder: Path):
    """(folder, Tokenizer, Config): the folder gets model.pt {model, config} and tokenizer.model."""
    import sentencepiece as spm

    from gdn2.tokenizer import Tokenizer

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text() * 2), model_prefix=str(folder / "tokenizer"), vocab_size=512,
        model_type="bpe", byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1)
    tok = Tokenizer(folder / "tokenizer.model")
    cfg = Config.from_name("swa_gdn2_tiny", vocab_size=tok.vocab_size, block_size=MAX_LENGTH,
                           n_layer=2, sliding_window=12, gdn2_recurrent_max_len=4)
    torch.manual_seed(0)
    model = GPT(cfg)
    # widen the logits so that greedy choices are far from ties (random init is nearly uniform)
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
    torch.save({"model": model.state_dict(), "config": cfg.to_dict()}, folder / "model.pt")
    return folder, tok, cfg
