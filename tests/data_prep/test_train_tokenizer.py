"""train_tokenizer.py: Llama-2 settings, streamed reservoir sampling, determinism, CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm
import zstandard
from sentencepiece import sentencepiece_model_pb2

from gdn2.data_prep.train_tokenizer import sample_sentences, split_long_line, train_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _proto(path):
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def test_model_carries_the_llama2_settings(tokenizer_model):
    proto = _proto(tokenizer_model)
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    assert spec.model_type == sentencepiece_model_pb2.TrainerSpec.BPE
    assert spec.vocab_size == 600 and len(proto.pieces) == 600
    assert spec.byte_fallback and spec.split_digits and spec.allow_whitespace_only_pieces
    assert (spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id) == (0, 1, 2, -1)
    assert spec.character_coverage == pytest.approx(0.99995) and spec.max_sentencepiece_length == 16
    assert norm.name == "identity" and norm.add_dummy_prefix and not norm.remove_extra_whitespaces
    assert [p.piece for p in proto.pieces[:5]] == ["<unk>", "<s>", "</s>", "\n", "\n\n"]  # newline pieces
    assert [p.piece for p in proto.pieces[5:261]] == [f"<0x{b:02X}>" for b in range(256)]


def test_tokenizer_behaviour(sp):
    assert sp.encode("1234", out_type=str)[-4:] == ["1", "2", "3", "4"]  # split digits
    rare = "☄"  # never in the training text: byte fallback, not <unk>
    pieces = sp.encode(rare, out_type=str)
    assert "<unk>" not in pieces and pieces[-3:] == ["<0xE2>", "<0x98>", "<0x84>"]
    for text in ["ＡＢＣ ﬁ x", "two  spaces\tand\ttabs\n\nnewlines", "    indented code"]:
        assert sp.decode(sp.encode(text)) == text  # identity normalisation, whitespace kept
    assert sp.encode("hello", add_bos=False, add_eos=False)[0] not in (1, 2)


def test_newline_modes(tmp_path, make_documents):
    """pieces: a paragraph break is one token of its own and the trainer sees whole documents;
    bytes: the trainer sees lines and newlines fall back to <0x0A>."""
    documents = make_documents(200, seed=4)
    text = "First line\nsecond line\n\nA new paragraph."
    models = {}
    for mode in ("pieces", "bytes"):
        (tmp_path / mode).mkdir()
        path = tmp_path / mode / "docs.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
        sentences = sample_sentences([str(path)], 10_000, None, seed=1, report=False, newlines=mode)
        assert any("\n" in s for s in sentences) == (mode == "pieces")
        models[mode] = spm.SentencePieceProcessor(model_file=str(
            train_tokenizer(sentences, tmp_path / mode / "tok.model", vocab_size=500, seed=1, newlines=mode)))
    pieces = models["pieces"].encode(text, out_type=str)
    assert "\n\n" in pieces and "\n" in pieces and not any(p.startswith("<0x") for p in pieces)
    assert models["bytes"].encode(text, out_type=str).count("<0x0A>") == 3
    for sp in models.values():
        assert sp.decode(sp.encode(text)) == text
    with pytest.raises(ValueError, match="--newlines"):
        sample_sentences([str(path)], 10, None, seed=1, report=False, newlines="lines")


def test_reservoir_sampling_is_streamed_bounded_and_seeded(tmp_path):
    lines = [f"line number {i} of the text file" for i in range(5000)]
    (tmp_path / "a.txt").write_text("\n".join(lines[:2500]) + "\n")
    (tmp_path / "b.txt").write_text("\n".join(lines[2500:]) + "\n")
    pattern = [str(tmp_path / "*.txt")]
    first = sample_sentences(pattern, max_sentences=100, max_documents=None, seed=3, report=False)
    assert len(first) == 100 and set(first) <= set(lines)
    assert sample_sentences(pattern, 100, None, seed=3, report=False) == first
    assert sample_sentences(pattern, 100, None, seed=4, report=False) != first
    # Samples come from both files (the reservoir sees the whole stream, not a prefix).
    numbers = sorted(int(s.split()[2]) for s in first)
    assert numbers[0] < 2500 <= numbers[-1]
    assert len(sample_sentences(pattern, 10_000, max_documents=300, seed=3, report=False)) == 300


def test_long_lines_are_cut_not_dropped():
    line = " ".join(["word"] * 3000) + " " + "é" * 5000
    pieces = split_long_line(line, 4192)
    assert all(len(p.encode()) <= 4192 for p in pieces)
    assert "".join(pieces) == line
    assert split_long_line("short", 4192) == ["short"]
    paragraphs = ("word " * 30 + "\n") * 20
    pieces = split_long_line(paragraphs, 400, after_newline=True)
    assert "".join(pieces) == paragraphs and all(p.endswith("\n") for p in pieces)


def test_training_is_deterministic(tmp_path):
    sentences = [f"the {i} quick brown foxes jump over {i * 7} lazy dogs" for i in range(2000)]
    a = train_tokenizer(sentences, tmp_path / "a" / "tok.model", vocab_size=300, seed=5)
    b = train_tokenizer(sentences, tmp_path / "b" / "tok.model", vocab_size=300, seed=5)
    assert [(p.piece, p.score) for p in _proto(a).pieces] == [(p.piece, p.score) for p in _proto(b).pieces]
    assert not list((tmp_path / "a").glob(".*"))  # no scratch left behind


def test_cli_reads_parquet_jsonl_zst_and_text(tmp_path, make_documents, write_fineweb_parquet):
    documents = make_documents(60, seed=3)
    write_fineweb_parquet(tmp_path / "a.parquet", documents[:20])
    with zstandard.ZstdCompressor().stream_writer(open(tmp_path / "b.jsonl.zst", "wb")) as f:
        for text in documents[20:40]:
            f.write((json.dumps({"text": text}) + "\n").encode())
    (tmp_path / "c.txt").write_text("\n".join(documents[40:]))
    result = subprocess.run(
        [sys.executable, "-m", "gdn2", "tokenizer", "--input", str(tmp_path / "a.parquet"),
         "--input", str(tmp_path / "b.jsonl.zst"), "--input", str(tmp_path / "c.txt"), "--vocab-size", "400",
         "--output", str(tmp_path / "out" / "tok.model"), "--max-sentences", "1000", "--seed", "1"],
        capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "tok.vocab").read_text().startswith("<unk>\t0\n<s>\t0\n</s>\t0\n\n\t0\n")
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "out" / "tok.model"))
    assert sp.vocab_size() == 400 and sp.eos_id() == 2


def test_too_small_vocabulary_is_a_clear_error(tmp_path):
    sentences = [f"{chr(0x4E00 + i)} common words" for i in range(300)]  # 300 distinct characters
    with pytest.raises(ValueError, match="--vocab_size 300"):
        train_tokenizer(sentences, tmp_path / "tok.model", vocab_size=300)
