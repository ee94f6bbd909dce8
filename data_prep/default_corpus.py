"""The built-in corpus: Python's own standard library sources, ready to train on, no download.

    python -m gdn2 corpus --output data/default [--vocab_size 4096] [--max_bytes 6000000]

Writes, in ``--output``: ``corpus.jsonl`` (one document per standard-library module, key
``text``), ``tokenizer.model`` / ``.vocab`` (SentencePiece BPE, Llama-2 settings, 4096 pieces by
default), ``train_*.bin`` / ``val_*.bin`` packed shards and ``manifest.json``. Each step is skipped
when its output exists, so a rerun is a no-op; about a minute on two cores.

The text is the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (code, comments,
docstrings; ``pydoc_data`` brings the prose of the language reference), without site-packages,
test suites and the codec tables of ``encodings``. Files are taken in an order fixed by a hash of
their relative path until ``--max_bytes``: the same Python version gives the same corpus, byte for
byte; other versions give a similar one.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gdn2.commandline import option, parse_options
from gdn2.data_prep.prepare import prepare
from gdn2.data_prep.train_tokenizer import sample_sentences, train_tokenizer
from gdn2.data.shards import MANIFEST_NAME, read_header
from gdn2.data.shards import shard_path as shard_path_in  # a shard a manifest lists, inside its folder
from gdn2.files import atomic_file

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"}
DEFAULT_MAX_BYTES = 6_000_000
DEFAULT_VOCAB_SIZE = 4096
# The corpus holds ~350 documents: 5% of them for validation is ~100K tokens.
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SHARD_TOKENS = 1 << 20


def stdlib_sources(max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[str, str]]:
    """(path relative to the stdlib, text) of standard-library modules, in a fixed pseudo-random
    order, until their UTF-8 size reaches ``max_bytes`` (files that do not decode are left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in EXCLUDED_DIRS)
        for name in sorted(files):
            if name.endswith(".py"):
                candidates.append((Path(directory) / name).relative_to(root).as_posix())
    # A hash order mixes packages (sorted order would be all asyncio, then collections, ...).
    candidates.sort(key=lambda rel: hashlib.blake2b(rel.encode(), digest_size=8).digest())
    documents, total = [], 0
    for rel in candidates:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        size = len(text.encode("utf-8"))
        if not text.strip() or (documents and total + size > max_bytes):
            continue  # a smaller file further on may still fit
        documents.append((rel, text))
        total += size
    if not documents:
        raise RuntimeError(f"no readable .py files under {root}")
    return documents


def write_corpus(path: Path, max_bytes: int) -> dict:
    documents = stdlib_sources(max_bytes)
    with atomic_file(path, "w", encoding="utf-8") as f:
        for rel, text in documents:
            f.write(json.dumps({"text": text, "id": f"stdlib/{rel}"}, ensure_ascii=False) + "\n")
    return {"documents": len(documents), "bytes": sum(len(t.encode()) for _, t in documents)}


def _finished_manifest(output: Path) -> dict | None:
    """The manifest of a finished corpus whose shards are all in place, else None. Checked by
    content rather than by prepare's input fingerprint, so that a copied directory (new mtimes)
    still counts as finished."""
    path = output / MANIFEST_NAME
    if not path.exists():
        return None
    manifest = json.loads(path.read_text())
    for split in ("train", "val"):
        for shard in manifest["shards"][split]:
            shard_path = shard_path_in(output, shard["name"], path)
            if not shard_path.exists() or read_header(shard_path)[1] != shard["tokens"]:
                return None
    return manifest


def build_default_corpus(output: str | os.PathLike = "data/default", vocab_size: int = DEFAULT_VOCAB_SIZE,
                         max_bytes: int = DEFAULT_MAX_BYTES, workers: int | None = None,
                         val_fraction: float = DEFAULT_VAL_FRACTION, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                         seed: int = 3407, progress: bool = True) -> dict:
    """Make (or finish) the default corpus in ``output``; returns its prepare manifest."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    corpus = output / "corpus.jsonl"
    tokenizer = output / "tokenizer.model"
    log = (lambda message: print(message, file=sys.stderr)) if progress else (lambda message: None)

    manifest = _finished_manifest(output)
    if manifest is not None and tokenizer.exists():
        log(f"{output}: already complete")
        return manifest
    if not corpus.exists():
        started = time.monotonic()
        info = write_corpus(corpus, max_bytes)
        log(f"{corpus}: {info['documents']} standard-library modules, {info['bytes'] / 1e6:.1f} MB "
            f"({time.monotonic() - started:.1f}s)")
    if not tokenizer.exists():
        started = time.monotonic()
        sentences = sample_sentences([str(corpus)], max_sentences=10_000_000, max_documents=None, seed=seed,
                                     report=progress)
        train_tokenizer(sentences, tokenizer, vocab_size=vocab_size, seed=seed)
        log(f"{tokenizer}: {vocab_size} pieces ({time.monotonic() - started:.1f}s)")
    return prepare([str(corpus)], tokenizer, output, workers=workers, val_fraction=val_fraction,
                   shard_tokens=shard_tokens, progress=progress)


@dataclass(kw_only=True)
class CorpusOptions:
    output: str = option("data/default", "output folder")
    vocab_size: int = option(DEFAULT_VOCAB_SIZE, "tokenizer pieces")
    max_bytes: int = option(DEFAULT_MAX_BYTES, "size cap of the text")
    workers: Optional[int] = option(None, "tokeniser processes", meaning_of_null="all cores")
    val_fraction: float = option(DEFAULT_VAL_FRACTION, "share of documents for validation (by a hash of the text)")
    shard_tokens: int = option(DEFAULT_SHARD_TOKENS, "tokens per shard")
    seed: int = option(3407, "tokenizer sampling seed")
    quiet: bool = option(False, "no progress bar")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_options(CorpusOptions, list(argv or []), "gdn2 corpus", __doc__.split("\n\n")[0])
    if args is None:
        return 0
    build_default_corpus(args.output, args.vocab_size, args.max_bytes, args.workers, args.val_fraction,
                         args.shard_tokens, args.seed, progress=not args.quiet)
    return 0


if __name__ == "__main__":  # in a checkout: python data_prep/default_corpus.py ... = python -m gdn2 corpus ...
    from gdn2.__main__ import run_script

    run_script("corpus")
