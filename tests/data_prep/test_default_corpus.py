"""default_corpus.py: the standard-library corpus, end to end, and its idempotence."""

import json
import os

import numpy as np
import pytest
import sentencepiece as spm

from gdn2.data_prep.default_corpus import build_default_corpus, finished_corpus, stdlib_sources
from gdn2.data.loader import TrainLoader, ValLoader
from gdn2.data.shards import write_shard


def test_stdlib_sources_are_deterministic_and_capped():
    a = stdlib_sources(max_bytes=200_000)
    assert a == stdlib_sources(max_bytes=200_000)
    assert sum(len(t.encode()) for _, t in a) <= 200_000 and len(a) > 5
    assert all(rel.endswith(".py") and "/test/" not in f"/{rel}" for rel, _ in a)


def test_build_default_corpus_end_to_end_and_rerun_is_a_no_op(tmp_path):
    out = tmp_path / "default"
    manifest = build_default_corpus(out, vocab_size=512, max_bytes=400_000, workers=1, val_fraction=0.1,
                                    shard_tokens=50_000, progress=False)
    for name in ("corpus.jsonl", "tokenizer.model", "tokenizer.vocab", "manifest.json", "train_0000000000.bin",
                 "val_0000000000.bin"):
        assert (out / name).exists(), name
    assert manifest["tokens"]["val"] > 0 and len(manifest["shards"]["train"]) >= 2
    assert json.loads((out / "manifest.json").read_text()) == manifest

    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert sp.vocab_size() == 512
    batch = next(iter(TrainLoader([(out, 1.0)], block_size=64, micro_batch_size=2)))
    assert int(batch["input_ids"].max()) < 512
    val = next(iter(ValLoader(out, block_size=64, micro_batch_size=2, num_batches=1)))
    text = sp.decode(val["input_ids"][0].tolist())
    documents = [json.loads(line)["text"] for line in (out / "corpus.jsonl").read_text().splitlines()]
    assert len(text) > 64 and any(doc.startswith(text) for doc in documents)  # starts the first val document

    os.utime(out / "corpus.jsonl")  # as after a copy: the finished corpus is recognised by content
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if not p.name.endswith(".lock")}
    assert build_default_corpus(out, vocab_size=512, max_bytes=400_000, workers=1, val_fraction=0.1,
                                shard_tokens=50_000, progress=False) == manifest
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if not p.name.endswith(".lock")} == stamps


def test_a_manifest_naming_a_shard_outside_the_folder_is_refused(tmp_path):
    """The shard names of a finished corpus's manifest are joined to its folder: one that climbs out of it
    (here to a valid shard elsewhere, which was read and accepted) is refused before anything is read, so
    the corpus does not count as finished (the build then makes its shards again)."""
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "default"
    elsewhere.mkdir()
    out.mkdir()
    write_shard(elsewhere / "train_0000000000.bin", np.arange(10, dtype=np.uint16))
    (out / "tokenizer.model").write_bytes(b"")
    shards = {"train": [{"name": "../elsewhere/train_0000000000.bin", "tokens": 10}], "val": []}
    (out / "manifest.json").write_text(json.dumps({"shards": shards}))
    with pytest.raises(ValueError, match=r"default/manifest.json: shard name '../elsewhere/train_0000000000.bin' is "
                                         r"not a file of its folder"):
        finished_corpus(out)
