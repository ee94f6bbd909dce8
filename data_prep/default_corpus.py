"""The built-in corpus: Python's own standard library sources, ready to train on, no download.

    python -m gdn2 corpus --output data/default [--vocab_size 4096] [--max_bytes 6000000]

Writes, in ``--output``: ``corpus.jsonl`` (one document per standard-library module, key
``text``), ``tokenizer.model`` / ``.vocab`` (SentencePiece BPE, Llama-2 settings, 4096 pieces by
default), ``train_*.bin`` / ``val_*.bin`` packed shards and ``manifest.json``. Each step is skipped
when its output exists, so a rerun is a no-op; about a minute on two cores.

One build at a time: a build holds a lock on the folder (``.corpus.lock``), and a second one (another
trainer starting on a fresh clone, say) waits for it, then finds the corpus finished. Every file is
written under a temporary name and renamed, so a reader never sees half of one; the corpus counts as
finished only when ``manifest.json`` and every shard it lists match.

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

from gdn2.commandline import option, parse_options, sigterm_stops
from gdn2.data_prep.prepare import check_finished, prepare
from gdn2.data_prep.train_tokenizer import sample_sentences, train_tokenizer
from gdn2.data.shards import read_manifest
from gdn2.files import FolderLock, atomic_file

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings"}
DEFAULT_MAX_BYTES = 6_000_000
DEFAULT_VOCAB_SIZE = 4096
# The corpus holds ~350 documents: 5% of them for validation is ~100K tokens.
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SHARD_TOKENS = 1 << 20
LOCK_NAME = ".corpus.lock"


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


def finished_corpus(output: str | os.PathLike) -> dict | None:
    """The manifest of a finished corpus in ``output`` (its tokenizer there, every shard matching the
    manifest), else None. Checked by content rather than by prepare's input fingerprint, so that a copied
    directory (new mtimes) still counts as finished. ValueError naming the manifest when it is damaged
    or does not match its shards."""
    output = Path(output)
    manifest = read_manifest(output)
    if manifest is None or not (output / "tokenizer.model").is_file():
        return None
    check_finished(output, manifest)
    return manifest


def build_default_corpus(output: str | os.PathLike = "data/default", vocab_size: int = DEFAULT_VOCAB_SIZE,
                         max_bytes: int = DEFAULT_MAX_BYTES, workers: int | None = None,
                         val_fraction: float = DEFAULT_VAL_FRACTION, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                         seed: int = 3407, progress: bool = True) -> dict:
    """Make (or finish) the default corpus in ``output``; returns its prepare manifest. Holds the folder's
    lock meanwhile: when another process is building it, says so and waits for it first."""
    output = Path(output)
    log = (lambda message: print(message, file=sys.stderr)) if progress else (lambda message: None)
    lock = FolderLock(output, LOCK_NAME)
    # said whatever ``progress`` is: a start that stalls needs a reason
    lock.acquire(wait=True, on_wait=lambda holder: print(
        f"{output}: the built-in corpus is being built by another process ({holder}); waiting for it to finish",
        file=sys.stderr, flush=True))
    try:
        return _build_locked(output, vocab_size, max_bytes, workers, val_fraction, shard_tokens, seed, progress, log)
    finally:
        lock.release()


def _build_locked(output: Path, vocab_size: int, max_bytes: int, workers: int | None, val_fraction: float,
                  shard_tokens: int, seed: int, progress: bool, log) -> dict:
    corpus = output / "corpus.jsonl"
    tokenizer = output / "tokenizer.model"
    overwrite = False
    try:
        manifest = finished_corpus(output)
    except ValueError as error:  # our own folder, rebuilt from the same sources: redo the shards
        log(f"{error}; making the shards again")
        manifest, overwrite = None, True
    if manifest is not None:
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
                   shard_tokens=shard_tokens, progress=progress, overwrite=overwrite)


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
    with sigterm_stops():  # a terminated build ends its workers and keeps its journal, as after Ctrl-C
        build_default_corpus(args.output, args.vocab_size, args.max_bytes, args.workers, args.val_fraction,
                             args.shard_tokens, args.seed, progress=not args.quiet)
    return 0


if __name__ == "__main__":  # in a checkout: python data_prep/default_corpus.py ... = python -m gdn2 corpus ...
    from gdn2.__main__ import run_script

    run_script("corpus")
