"""Shared fixtures: FineWeb-Edu-shaped parquet files and a real SentencePiece tokenizer trained once."""

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have "
         "an they you were her she there been one all we their has would when if so no will more about time "
         "model learning gradient attention memory state delta rule gate decay token sequence parquet shard "
         "café naïve über straße résumé 東京 数据 данные λόγος").split()


def _make_documents(count: int, seed: int) -> list[str]:
    """Deterministic English-like documents with numbers, punctuation, non-ASCII, blank lines and
    indentation, 20-400 words each."""
    rng = random.Random(seed)
    documents = []
    for _ in range(count):
        paragraphs = []
        for _ in range(rng.randint(1, 4)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(20, 100))]
            for i in range(0, len(words), rng.randint(6, 15)):
                words[i] = words[i].capitalize()
            if rng.random() < 0.5:
                words.insert(rng.randrange(len(words)), str(rng.randint(0, 10**rng.randint(1, 7))))
            paragraphs.append(("    " if rng.random() < 0.2 else "") + " ".join(words) + ".")
        if rng.random() < 0.1:
            paragraphs.append("Emoji 😀 and a rare ☃ character.")
        documents.append("\n\n".join(paragraphs))
    return documents


def _write_fineweb_parquet(path, texts, row_group_size: int = 64, text_type=pa.string()) -> None:
    """A parquet file with the FineWeb-Edu columns; ``texts`` may hold None (a null text)."""
    n = len(texts)
    table = pa.table({
        "text": pa.array(texts, type=text_type),
        "id": [f"<urn:uuid:{i:08x}>" for i in range(n)],
        "dump": ["CC-MAIN-2024-10"] * n,
        "url": [f"https://example.org/{i}" for i in range(n)],
        "file_path": ["s3://commoncrawl/crawl-data/x.warc.gz"] * n,
        "language": ["en"] * n,
        "language_score": pa.array([0.95] * n, type=pa.float64()),
        "token_count": pa.array([len(t or "") // 4 for t in texts], type=pa.int64()),
        "score": pa.array([3.1] * n, type=pa.float64()),
        "int_score": pa.array([3] * n, type=pa.int64()),
    })
    pq.write_table(table, path, row_group_size=row_group_size)


@pytest.fixture(scope="session")
def make_documents():
    return _make_documents


@pytest.fixture(scope="session")
def write_fineweb_parquet():
    return _write_fineweb_parquet


@pytest.fixture(scope="session")
def tokenizer_model(tmp_path_factory):
    """A 600-piece Llama-2-style BPE tokenizer trained (once) with the project's trainer."""
    from gdn2.data_prep.train_tokenizer import sample_sentences, train_tokenizer

    root = tmp_path_factory.mktemp("tokenizer")
    _write_fineweb_parquet(root / "corpus.parquet", _make_documents(300, seed=99))
    sentences = sample_sentences([str(root / "corpus.parquet")], max_sentences=5000, max_documents=None,
                                 seed=1, report=False)
    return train_tokenizer(sentences, root / "tok.model", vocab_size=600, seed=1)


@pytest.fixture(scope="session")
def sp(tokenizer_model):
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(tokenizer_model))
