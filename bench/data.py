"""Data pipeline throughput: tokenisation by prepare.py, and TrainLoader batches.

    python bench/data.py [--corpus-mb 24] [--vocab-size 8192] [--workers N] [--loader-batches 300]

1. Generates a FineWeb-Edu-shaped parquet corpus of English-like text (pseudo-words drawn from a
   Zipfian lexicon, numbers, punctuation, paragraphs), row groups of 1000 documents.
2. Trains a tokenizer on it with ``gdn2 tokenizer``'s settings (``--vocab_size``;
   pass ``--tokenizer`` to use an existing one instead).
3. Times ``prepare()`` end to end (planning, worker start-up, tokenising, writing shards) with one
   worker and with ``--workers``: tokens/s in total and per worker; and SentencePiece's own
   single-thread encode speed on the same text as the ceiling per core.
4. Times ``TrainLoader`` (block 4096, micro-batch 8, num_workers=0: one process) on synthetic
   shards, with and without document masking: tokens/s per process.

Prints a table and writes ``data.json`` to ``$OUT`` (or ``./bench_out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gdn2.data_prep.prepare import prepare  # noqa: E402
from gdn2.data_prep.train_tokenizer import sample_sentences, train_tokenizer  # noqa: E402
from gdn2.data.shards import write_shard  # noqa: E402

SYLLABLES = ("ka ti ro ne su ma lo pe di an er in on at es th ch sh qu str pr gr bl ou ea io "
             "ing ed ly tion ment ness able al ic ous").split()


def make_lexicon(size: int, rng: random.Random) -> tuple[list[str], list[float]]:
    words = sorted({"".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(size * 2)})[:size]
    rng.shuffle(words)
    weights = [1.0 / (rank + 1) for rank in range(len(words))]  # Zipf's law
    return words, weights


def make_document(rng: random.Random, words: list[str], cumulative: list[float]) -> str:
    paragraphs = []
    for _ in range(rng.randint(1, 6)):
        sentences = []
        for _ in range(rng.randint(2, 8)):
            n = rng.randint(5, 25)
            sentence = rng.choices(words, cum_weights=cumulative, k=n)
            if rng.random() < 0.3:
                sentence.insert(rng.randrange(n), str(rng.randint(0, 99999)))
            if rng.random() < 0.2:
                sentence[rng.randrange(n)] += ","
            sentences.append(" ".join(sentence).capitalize() + rng.choice(".!?"))
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs)


def write_corpus(directory: Path, megabytes: float, seed: int = 0) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    words, weights = make_lexicon(60_000, rng)
    cumulative = list(np.cumsum(weights))
    target, total, file_index, documents = int(megabytes * 1e6), 0, 0, 0
    while total < target:
        texts = []
        while total < target and len(texts) < 5000:
            texts.append(make_document(rng, words, cumulative))
            total += len(texts[-1].encode())
        n = len(texts)
        table = pa.table({
            "text": texts, "id": [f"doc-{documents + i}" for i in range(n)], "dump": ["CC-MAIN-2024-10"] * n,
            "url": [f"https://example.org/{documents + i}" for i in range(n)], "file_path": ["synthetic"] * n,
            "language": ["en"] * n, "language_score": [0.9] * n, "token_count": [len(t) // 4 for t in texts],
            "score": [3.0] * n, "int_score": [3] * n,
        })
        pq.write_table(table, directory / f"part_{file_index:04d}.parquet", row_group_size=1000)
        file_index += 1
        documents += n
    return {"files": file_index, "documents": documents, "bytes": total}


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished (reaped) children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def bench_prepare(corpus: Path, tokenizer: Path, workers: int, scratch: Path) -> dict:
    out = Path(tempfile.mkdtemp(dir=scratch))
    cpu, started = _cpu_seconds(), time.perf_counter()
    manifest = prepare([str(corpus / "*.parquet")], tokenizer, out, workers=workers, val_fraction=0.0005,
                       progress=False)
    seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    tokens = manifest["tokens"]["train"] + manifest["tokens"]["val"]
    # On a shared machine wall time depends on the neighbours; tokens per CPU-second does not.
    return {"workers": workers, "seconds": seconds, "cpu_seconds": cpu, "tokens": tokens,
            "documents": manifest["documents"]["read"], "tokens_per_s": tokens / seconds,
            "tokens_per_s_per_worker": tokens / seconds / workers, "tokens_per_cpu_s": tokens / cpu}


def bench_encode_ceiling(corpus: Path, tokenizer: Path, max_documents: int = 3000) -> dict:
    import pyarrow.parquet as pq
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    texts = pq.read_table(sorted(corpus.glob("*.parquet"))[0], columns=["text"]).column(0).to_pylist()[:max_documents]
    cpu, started = time.process_time(), time.perf_counter()
    tokens = sum(len(ids) for ids in sp.encode(texts, num_threads=1))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "tokens_per_cpu_s": tokens / cpu,
            "bytes_per_token": sum(len(t.encode()) for t in texts) / tokens}


def bench_loader(scratch: Path, batches: int, block_size: int = 4096, micro_batch_size: int = 8) -> list[dict]:
    # Imported here: prepare()'s worker processes re-import this module, and must not pay for torch.
    from gdn2.data.loader import TrainLoader

    directory = scratch / "loader_shards"
    directory.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):  # 2 x 32M tokens: 128 MiB, larger than any cache on the way
        write_shard(directory / f"train_{i:010d}.bin", rng.integers(0, 32000, 1 << 25, dtype=np.uint16))
    results = []
    for masking in (False, True):
        loader = TrainLoader([(directory, 1.0)], block_size, micro_batch_size, document_masking=masking)
        iterator = iter(loader)
        for _ in range(10):  # first touch of the permutation and the page cache
            next(iterator)
        cpu, started = time.process_time(), time.perf_counter()
        for _ in range(batches):
            next(iterator)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        tokens = batches * micro_batch_size * block_size
        results.append({"block_size": block_size, "micro_batch_size": micro_batch_size, "document_masking": masking,
                        "batches": batches, "seconds": seconds, "tokens_per_s": tokens / seconds,
                        "tokens_per_cpu_s": tokens / cpu, "batches_per_s": batches / seconds})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus-mb", type=float, default=24.0)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokenizer", default=None, help="an existing .model instead of training one")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--loader-batches", type=int, default=300)
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT") or "bench_out")
    out_dir.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="gdn2_bench_data_") as tmp:
        scratch = Path(tmp)
        corpus = scratch / "corpus"
        corpus.mkdir()
        started = time.perf_counter()
        corpus_info = write_corpus(corpus, args.corpus_mb)
        print(f"corpus: {corpus_info['documents']:,} documents, {corpus_info['bytes'] / 1e6:.1f} MB in "
              f"{corpus_info['files']} parquet files ({time.perf_counter() - started:.1f}s)", file=sys.stderr)
        if args.tokenizer:
            tokenizer = Path(args.tokenizer)
        else:
            started = time.perf_counter()
            sentences = sample_sentences([str(corpus / "*.parquet")], 200_000, None, seed=0, report=False)
            tokenizer = train_tokenizer(sentences, scratch / "tok.model", vocab_size=args.vocab_size)
            print(f"tokenizer: {args.vocab_size} pieces ({time.perf_counter() - started:.1f}s)", file=sys.stderr)

        ceiling = bench_encode_ceiling(corpus, tokenizer)
        worker_counts = sorted({1, args.workers})
        prepare_runs = [bench_prepare(corpus, tokenizer, w, scratch) for w in worker_counts]
        loader_runs = bench_loader(scratch, args.loader_batches)

    result = {
        "machine": {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform(),
                    "python": platform.python_version()},
        "corpus": corpus_info, "vocab_size": args.vocab_size if not args.tokenizer else None,
        "sentencepiece_encode_single_thread": ceiling, "prepare": prepare_runs, "loader": loader_runs,
    }
    print("\nprepare.py tokenisation (parquet -> shards, end to end)")
    print(f"{'workers':>8} {'tokens':>12} {'seconds':>8} {'tok/s total':>12} {'tok/s/worker':>13} {'tok/CPU-s':>10}")
    for run in prepare_runs:
        print(f"{run['workers']:>8} {run['tokens']:>12,} {run['seconds']:>8.2f} {run['tokens_per_s']:>12,.0f} "
              f"{run['tokens_per_s_per_worker']:>13,.0f} {run['tokens_per_cpu_s']:>10,.0f}")
    print(f"SentencePiece encode alone, one thread: {ceiling['tokens_per_s']:,.0f} tok/s, "
          f"{ceiling['tokens_per_cpu_s']:,.0f} tok/CPU-s ({ceiling['bytes_per_token']:.2f} bytes/token)")
    print("\nTrainLoader, one process (num_workers=0)")
    print(f"{'block':>6} {'micro':>6} {'doc mask':>9} {'tok/s':>14} {'tok/CPU-s':>14} {'batches/s':>10}")
    for run in loader_runs:
        print(f"{run['block_size']:>6} {run['micro_batch_size']:>6} {str(run['document_masking']):>9} "
              f"{run['tokens_per_s']:>14,.0f} {run['tokens_per_cpu_s']:>14,.0f} {run['batches_per_s']:>10,.1f}")
    (out_dir / "data.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out_dir / 'data.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
