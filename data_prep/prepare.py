"""Tokenise a corpus into packed shards (lit-gpt ``LITPKDS`` format), in parallel and resumably.

    python -m gdn2 prepare --input 'fineweb-edu/sample/10BT/*.parquet' \\
        --tokenizer tokenizer.model --output data/fineweb-edu-10BT [--workers N] \\
        [--val_input 'heldout/*.jsonl.zst' | --val_fraction 0.0005] [--shard_tokens 134217728]

Inputs: parquet files (column ``text``, read one record batch at a time) and JSON-lines files
(``.jsonl`` / ``.json`` / ``.ndjson``, optionally ``.zst`` or ``.gz``; key ``text``).

Output, in ``--output``: ``train_{i:010d}.bin`` and ``val_{i:010d}.bin`` (format in
``gdn2/data/shards.py``) and ``manifest.json``. Each document is tokenised without BOS and followed
by EOS; documents run on across shard ends; every shard is full except the last of each split.
A document goes to validation when the first 8 bytes of blake2b(its UTF-8 text), read as a
little-endian integer, fall below ``val_fraction * 2**64``: the split depends on the text alone,
so duplicates land on the same side and reruns agree.

Validation. ``--val_input`` names held-out files: every document of theirs goes to ``val_*.bin`` and
none to training (the manifest records each input's split). With ``--val_input`` the hash split of
``--input`` is off unless ``--val_fraction`` is given too.

Determinism and resumption. The inputs are cut into *work units* in a fixed order: at most 4096
rows of a parquet row group, or about 4 MiB of JSON-lines / text (a byte range of a plain file;
a range of whole lines of the decompressed stream of a ``.zst`` / ``.gz`` file, found by one
scan when the job is planned, and read by the main process, which hands the bytes to a worker).
So every worker has work and the progress bar moves every few seconds whatever the mix of file
sizes. Workers tokenise units in parallel into temporary files; the main process appends them to the shards strictly in
unit order and, after each unit, syncs the files and atomically rewrites a journal
(``.prepare_journal.json``: units done, shards finished, tokens in the open shard, counters).
Rerunning the same command after a crash, a kill or ``--time_limit`` truncates the open shard to the
journal and continues with the next unit: the result is byte-identical to an uninterrupted run,
whatever ``--workers`` is. SIGTERM and Ctrl-C stop a run the same way, with one line saying how far it
got: the workers are ended and the journal stays as the last finished unit left it.

One run at a time: a run holds a lock on ``--output`` (``.prepare.lock``), and a second one is refused,
naming the holder's pid and host (a lock whose holder died is free again at once). A rerun on a
finished output (``manifest.json`` present) checks every shard against the manifest's counts (each
listed shard present with the recorded tokens, the totals adding up, no shard it does not list) and
then does nothing; an output that does not match is refused with a line naming what differs.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import hashlib
import io
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from gdn2.commandline import Stopped, option, parse_options, sigterm_stops
from gdn2.data.shards import (CODE_OF_DTYPE, HEADER_SIZE, MANIFEST_NAME, pack_header, read_header, read_manifest,
                              token_dtype_for_vocab)
from gdn2.data.shards import shard_path as shard_path_in  # a shard a manifest lists, inside its folder
from gdn2.files import FolderLock, file_sha256, fsync_dir, write_json_atomic

PARQUET_SUFFIXES = (".parquet",)
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt",)
COMPRESSION_SUFFIXES = (".zst", ".zstd", ".gz")

# Size of one work unit of a JSON-lines or text file (bytes of the file, or of its decompressed
# stream); a parquet unit is at most PARQUET_UNIT_ROWS rows of one row group, read in batches.
JSONL_UNIT_BYTES = 4 << 20
PARQUET_BATCH_ROWS = 1024
PARQUET_UNIT_ROWS = 4 * PARQUET_BATCH_ROWS
# Documents handed to SentencePiece per call.
ENCODE_BATCH_DOCS = 256

JOURNAL_NAME = ".prepare_journal.json"
TMP_DIR_NAME = ".prepare_tmp"
LOCK_NAME = ".prepare.lock"
SPLITS = ("train", "val")
SKIP_REASONS = ("empty", "undecodable", "missing_text", "bad_json")
MAX_SKIP_EXAMPLES = 5
FORMAT_VERSION = 1
EXIT_INCOMPLETE = 3


# ----------------------------------------------------------------------------------------------
# Inputs: discovery, work units, documents


def input_kind(path: str | os.PathLike) -> tuple[str, str | None]:
    """(``"parquet" | "jsonl" | "text"``, compression or None) from a file name."""
    name = Path(path).name.lower()
    compression = None
    for suffix in COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            compression, name = suffix.lstrip(".").replace("zstd", "zst"), name[: -len(suffix)]
            break
    if name.endswith(PARQUET_SUFFIXES) and compression is None:
        return "parquet", None
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl", compression
    if name.endswith(TEXT_SUFFIXES):
        return "text", compression
    raise ValueError(
        f"{path}: unsupported input type (expected .parquet, .jsonl/.json/.ndjson[.zst|.gz] or .txt[.zst|.gz])"
    )


def expand_inputs(patterns: Sequence[str], kinds: Sequence[str] = ("parquet", "jsonl"),
                  flag: str = "--input") -> list[Path]:
    """Files matching the glob ``patterns``: each pattern's matches sorted, patterns in the given
    order, duplicates dropped. A pattern matching nothing, or a file of another kind, is an error
    (naming ``flag``)."""
    if not patterns:
        raise ValueError(f"{flag}: at least one file or glob pattern is required")
    seen: dict[Path, None] = {}
    for pattern in patterns:
        matches = sorted(Path(p).resolve() for p in glob.glob(os.path.expanduser(pattern), recursive=True))
        matches = [p for p in matches if p.is_file()]
        if not matches:
            raise FileNotFoundError(f"{flag}: no files match {pattern!r}")
        for path in matches:
            kind, _ = input_kind(path)
            if kind not in kinds:
                raise ValueError(f"{path}: {kind} inputs are not accepted here (expected {', '.join(kinds)})")
            seen.setdefault(path, None)
    return list(seen)


@dataclass(frozen=True)
class WorkUnit:
    """A piece of one input file that one worker tokenises.

    Parquet: ``rows`` rows of row group ``row_group`` starting ``offset`` rows into it (``first_row``
    counts from the start of the file). Uncompressed JSON-lines / text: the lines whose first byte
    lies in ``[start, end)``. Compressed: the whole lines in ``[start, end)`` of the decompressed
    stream (``first_row`` is the line number of the first), or the whole file when ``end == -1``.
    ``split`` is ``"val"`` for a ``--val_input`` file, None when the hash decides.
    """

    path: str
    kind: str
    compression: str | None = None
    row_group: int = -1
    first_row: int = 0
    rows: int = 0
    offset: int = 0
    start: int = 0
    end: int = -1
    split: str | None = None


def _parquet_text_field(path: Path, text_key: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises several types for a damaged footer
        raise ValueError(f"{path}: not a readable parquet file ({error})") from error
    schema = parquet.schema_arrow
    if text_key not in schema.names:
        raise ValueError(f"{path}: parquet file has no column {text_key!r} (columns: {', '.join(schema.names)})")
    field_type = schema.field(text_key).type
    if not (pa.types.is_string(field_type) or pa.types.is_large_string(field_type)
            or pa.types.is_binary(field_type) or pa.types.is_large_binary(field_type)):
        raise ValueError(f"{path}: column {text_key!r} has type {field_type}, expected string or binary")
    return parquet


def _line_cuts(path: Path, compression: str, unit_bytes: int) -> tuple[list[tuple[int, int]], int]:
    """One pass over a compressed file's stream: ``[(offset, line number)]`` of the line starts that
    begin its units (the first line starting at or after each ``unit_bytes`` mark), and its size."""
    cuts = [(0, 1)]
    position = lines = 0
    target = unit_bytes  # the next unit begins with the first line starting at or after this offset
    with _open_stream(str(path), compression) as f:
        while block := f.read(1 << 22):
            end = position + len(block)
            while target <= end:
                newline = block.find(b"\n", max(target - 1 - position, 0))
                if newline < 0:
                    break
                cut = position + newline + 1
                cuts.append((cut, lines + block.count(b"\n", 0, newline + 1) + 1))
                target = cut + unit_bytes
            lines += block.count(b"\n")
            position = end
    if cuts[-1][0] >= position and len(cuts) > 1:
        cuts.pop()  # the file ends with a newline exactly at a cut
    return cuts, position


def plan_units(path: Path, text_key: str = "text", split: str | None = None,
               split_compressed: bool = True) -> list[WorkUnit]:
    """The work units of one input file, in stream order (checks a parquet file's schema).

    ``split_compressed=False`` keeps a compressed file as one unit (no planning scan), for readers
    that visit units one at a time anyway.
    """
    kind, compression = input_kind(path)
    if kind == "parquet":
        metadata = _parquet_text_field(path, text_key).metadata
        units, first = [], 0
        for rg in range(metadata.num_row_groups):
            rows = metadata.row_group(rg).num_rows
            for offset in range(0, rows, PARQUET_UNIT_ROWS):
                take = min(PARQUET_UNIT_ROWS, rows - offset)
                units.append(WorkUnit(str(path), kind, row_group=rg, first_row=first + offset, rows=take,
                                      offset=offset, split=split))
            first += rows
        return units
    if compression is not None:
        if not split_compressed:
            return [WorkUnit(str(path), kind, compression, split=split)]
        cuts, size = _line_cuts(path, compression, JSONL_UNIT_BYTES)
        ends = [offset for offset, _ in cuts[1:]] + [size]
        return [WorkUnit(str(path), kind, compression, first_row=line, start=offset, end=end, split=split)
                for (offset, line), end in zip(cuts, ends)]
    size = path.stat().st_size
    return [WorkUnit(str(path), kind, start=s, end=min(s + JSONL_UNIT_BYTES, size), split=split)
            for s in range(0, max(size, 1), JSONL_UNIT_BYTES)]


class Skipped(str):
    """A document that cannot be used; the string is the reason (one of ``SKIP_REASONS``)."""


def _open_stream(path: str, compression: str | None):
    raw = open(path, "rb")
    if compression == "zst":
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    if compression == "gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    return raw


def _lines(unit: WorkUnit, data: bytes | None = None) -> Iterator[tuple[str, bytes]]:
    """(location, raw line) of the lines of a unit; a line belongs to the unit its first byte is in.

    ``data``: the unit's bytes, already read (a compressed unit's range of the decompressed stream).
    """
    if unit.compression is not None and unit.end != -1:
        if data is None:  # read on our own: decompress up to the unit (the main process avoids this)
            with _open_stream(unit.path, unit.compression) as f:
                _skip(f, unit.start)
                data = f.read(unit.end - unit.start)
        for number, line in enumerate(io.BytesIO(data), start=unit.first_row):
            yield f"line {number}", line
        return
    with _open_stream(unit.path, unit.compression) as f:
        if unit.end == -1:
            for number, line in enumerate(f, start=1):
                yield f"line {number}", line
            return
        if unit.start > 0:
            f.seek(unit.start - 1)
            f.readline()  # the rest of a line begun in the previous unit (or just its newline)
        position = f.tell()
        while position < unit.end:
            line = f.readline()
            if not line:
                break
            yield f"byte {position}", line
            position += len(line)


def _skip(stream, count: int) -> None:
    while count > 0:
        block = stream.read(min(count, 1 << 22))
        if not block:
            break
        count -= len(block)


class _StreamCursor:
    """Reads the ranges of compressed units in order, each file's stream opened once."""

    def __init__(self) -> None:
        self._path: str | None = None
        self._stream = None
        self._position = 0

    def read(self, unit: WorkUnit) -> bytes:
        if self._path != unit.path or self._position > unit.start:
            self.close()
            self._stream = _open_stream(unit.path, unit.compression)
            self._path, self._position = unit.path, 0
        _skip(self._stream, unit.start - self._position)
        data = self._stream.read(unit.end - unit.start)
        self._position = unit.start + len(data)
        return data

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._path, self._stream = None, None


def _check_text(value) -> str:
    if not isinstance(value, str):
        return Skipped("missing_text")
    try:
        value.encode("utf-8")  # lone surrogates from JSON escapes cannot be tokenised
    except UnicodeEncodeError:
        return Skipped("undecodable")
    if not value.strip():
        return Skipped("empty")
    return value


def _decode(raw: bytes | None):
    if raw is None:
        return Skipped("missing_text")
    try:
        return _check_text(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return Skipped("undecodable")


def read_documents(unit: WorkUnit, text_key: str = "text",
                   data: bytes | None = None) -> Iterator[tuple[str, str | Skipped]]:
    """(location, text or ``Skipped(reason)``) for every document of a unit, in order.

    Parquet is read one record batch of ``PARQUET_BATCH_ROWS`` rows at a time; text files yield one
    document per non-blank line; JSON-lines blank lines are not documents. ``data``: the bytes of a
    compressed unit, when the caller has read them.
    """
    if unit.kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        parquet = pq.ParquetFile(unit.path)
        row = unit.first_row
        skip, left = unit.offset, unit.rows
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[unit.row_group],
                                          columns=[text_key], use_threads=False):
            if skip >= batch.num_rows:  # rows of the row group before this unit: not converted
                skip -= batch.num_rows
                continue
            if left <= 0:
                break
            batch = batch.slice(skip, left)
            skip, left = 0, left - batch.num_rows
            column = batch.column(0)
            values = None
            if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
                try:
                    values = [_check_text(v) if v is not None else Skipped("missing_text") for v in column.to_pylist()]
                except UnicodeDecodeError:  # parquet does not validate UTF-8: decode one by one
                    column = column.view(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
            if values is None:
                values = [_decode(v) for v in column.to_pylist()]
            for value in values:
                yield f"row {row}", value
                row += 1
        return
    for location, line in _lines(unit, data):
        if not line.strip():
            continue
        if unit.kind == "text":
            yield location, _decode(line.rstrip(b"\r\n"))
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            yield location, Skipped("undecodable")
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            yield location, Skipped("bad_json")
            continue
        if not isinstance(record, dict):
            yield location, Skipped("bad_json")
            continue
        yield location, _check_text(record.get(text_key))


def is_validation(text_bytes: bytes, val_fraction: float) -> bool:
    """The stable train/validation split of one document (see the module docstring)."""
    digest = hashlib.blake2b(text_bytes, digest_size=8).digest()
    return int.from_bytes(digest, "little") < val_fraction * 2.0**64


# ----------------------------------------------------------------------------------------------
# Tokenisation of one unit (runs in worker processes)

_worker_tokenizer = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    import sentencepiece as spm

    _worker_tokenizer = spm.SentencePieceProcessor(model_file=tokenizer_path)


def _init_pool_worker(tokenizer_path: str) -> None:
    # Ctrl-C reaches the whole process group: the main process answers it (it ends the pool), a worker
    # that raised KeyboardInterrupt too would only print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(tokenizer_path)


def _empty_stats() -> dict:
    return {
        "documents_read": 0,
        "documents_kept": {split: 0 for split in SPLITS},
        "tokens": {split: 0 for split in SPLITS},
        "documents_skipped": {reason: 0 for reason in SKIP_REASONS},
        "skipped_examples": {reason: [] for reason in SKIP_REASONS},
    }


def _add_stats(total: dict, part: dict) -> None:
    total["documents_read"] += part["documents_read"]
    for key in ("documents_kept", "tokens", "documents_skipped"):
        for name, value in part[key].items():
            total[key][name] += value
    for reason, examples in part["skipped_examples"].items():
        room = MAX_SKIP_EXAMPLES - len(total["skipped_examples"][reason])
        total["skipped_examples"][reason].extend(examples[: max(room, 0)])


def encode_unit(unit: WorkUnit, tmp_prefix: str, text_key: str, val_fraction: float, dtype: str,
                eos_id: int, data: bytes | None = None) -> dict:
    """Tokenise one unit into ``{tmp_prefix}.train`` / ``.val`` (raw tokens of ``dtype``, each
    document + EOS, in document order); returns the unit's counters and the worker's ``pid``.
    ``data``: the bytes of a compressed unit, read by the caller."""
    tokenizer = _worker_tokenizer
    stats = _empty_stats()
    outputs = {split: open(f"{tmp_prefix}.{split}", "wb") for split in SPLITS}
    texts: list[str] = []
    splits: list[str] = []

    def flush() -> None:
        ids_per_doc = tokenizer.encode(texts, out_type=int, num_threads=1)
        flat: dict[str, list[int]] = {split: [] for split in SPLITS}
        for split, ids in zip(splits, ids_per_doc):
            flat[split].extend(ids)
            flat[split].append(eos_id)
            stats["tokens"][split] += len(ids) + 1
        for split in SPLITS:
            if flat[split]:
                np.asarray(flat[split], dtype=dtype).tofile(outputs[split])
        texts.clear()
        splits.clear()

    try:
        for location, text in read_documents(unit, text_key, data):
            stats["documents_read"] += 1
            if isinstance(text, Skipped):
                stats["documents_skipped"][text] += 1
                if len(stats["skipped_examples"][text]) < MAX_SKIP_EXAMPLES:
                    stats["skipped_examples"][text].append(f"{unit.path} {location}")
                continue
            split = unit.split or ("val" if is_validation(text.encode("utf-8"), val_fraction) else "train")
            stats["documents_kept"][split] += 1
            texts.append(text)
            splits.append(split)
            if len(texts) >= ENCODE_BATCH_DOCS:
                flush()
        if texts:
            flush()
    finally:
        for f in outputs.values():
            f.close()
    stats["pid"] = os.getpid()
    return stats


def _encode_unit_task(args: tuple) -> dict:
    return encode_unit(*args)


# ----------------------------------------------------------------------------------------------
# Output: shard writer and journal


def shard_name(prefix: str, index: int) -> str:
    return f"{prefix}_{index:010d}.bin"


class ShardWriter:
    """Appends tokens to ``{prefix}_{i:010d}.bin`` files of exactly ``shard_tokens`` tokens.

    The shard being filled is ``{name}.partial`` (its header count is patched when it is closed),
    so readers globbing ``*.bin`` never see it. ``shards`` lists the token counts of the closed ones.
    """

    def __init__(self, directory: Path, prefix: str, dtype: np.dtype, shard_tokens: int,
                 shards: list[int], partial_tokens: int):
        self.directory, self.prefix, self.dtype, self.shard_tokens = directory, prefix, np.dtype(dtype), shard_tokens
        self.shards = list(shards)
        self.partial_tokens = partial_tokens
        self._file = None
        self._recover()

    def _path(self, index: int, partial: bool = False) -> Path:
        return self.directory / (shard_name(self.prefix, index) + (".partial" if partial else ""))

    def _recover(self) -> None:
        """Bring the directory back to the journal's state: closed shards 0..n-1 as recorded, the
        open one truncated to ``partial_tokens`` (it may have been closed after the journal was
        written), and nothing beyond."""
        n = len(self.shards)
        for index, count in enumerate(self.shards):
            path = self._path(index)
            if not path.exists() or read_header(path)[1] != count:
                raise ValueError(f"{path}: missing or changed since the journal recorded it; rerun with --overwrite")
        for path in list(self.directory.glob(f"{self.prefix}_*.bin")) + list(self.directory.glob(f"{self.prefix}_*.bin.partial")):
            index = path.name[len(self.prefix) + 1:].split(".")[0]
            if index.isdigit() and int(index) > n:
                path.unlink()
        if self._path(n).exists():
            os.replace(self._path(n), self._path(n, partial=True))
        partial = self._path(n, partial=True)
        expected = HEADER_SIZE + self.partial_tokens * self.dtype.itemsize
        if self.partial_tokens > 0 and (not partial.exists() or partial.stat().st_size < expected):
            raise ValueError(f"{partial}: missing or shorter than the journal recorded; rerun with --overwrite")
        if partial.exists():
            with open(partial, "r+b") as f:
                f.truncate(expected)

    def _open(self):
        if self._file is None:
            path = self._path(len(self.shards), partial=True)
            if path.exists():
                self._file = open(path, "r+b")
                self._file.seek(0, os.SEEK_END)
            else:
                self._file = open(path, "wb")
                self._file.write(pack_header(self.dtype, 0))
        return self._file

    def _close_shard(self) -> None:
        f = self._file
        f.seek(0)
        f.write(pack_header(self.dtype, self.partial_tokens))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self._file = None
        index = len(self.shards)
        os.replace(self._path(index, partial=True), self._path(index))
        self.shards.append(self.partial_tokens)
        self.partial_tokens = 0

    def append(self, tokens: np.ndarray) -> None:
        offset = 0
        while offset < len(tokens):
            take = min(len(tokens) - offset, self.shard_tokens - self.partial_tokens)
            f = self._open()
            f.write(np.ascontiguousarray(tokens[offset:offset + take], dtype=self.dtype.newbyteorder("<")).tobytes())
            self.partial_tokens += take
            offset += take
            if self.partial_tokens == self.shard_tokens:
                self._close_shard()

    def append_file(self, path: Path, chunk_tokens: int = 1 << 24) -> None:
        """Append the raw tokens of ``path`` (written by ``encode_unit``), a chunk at a time."""
        total = path.stat().st_size // self.dtype.itemsize
        for start in range(0, total, chunk_tokens):
            count = min(chunk_tokens, total - start)
            self.append(np.fromfile(path, dtype=self.dtype, count=count, offset=start * self.dtype.itemsize))

    def sync(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def finish(self) -> None:
        """Close the last shard with its true token count (an empty one is not written)."""
        if self.partial_tokens > 0:
            self._open()
            self._close_shard()
        else:
            if self._file is not None:
                self._file.close()
                self._file = None
            self._path(len(self.shards), partial=True).unlink(missing_ok=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ----------------------------------------------------------------------------------------------
# The job


def load_tokenizer_info(tokenizer: Path, dtype: str) -> dict:
    """Vocabulary size, EOS/BOS ids and the token dtype for a SentencePiece model; raises a
    ValueError naming the file when it has no EOS or its vocabulary does not fit ``dtype``."""
    import sentencepiece as spm

    if not tokenizer.is_file():
        raise FileNotFoundError(f"--tokenizer: {tokenizer} does not exist")
    try:
        processor = spm.SentencePieceProcessor(model_file=str(tokenizer))
    except Exception as error:
        raise ValueError(f"{tokenizer}: not a SentencePiece model ({error})") from error
    vocab_size = processor.get_piece_size()
    if processor.eos_id() < 0:
        raise ValueError(f"{tokenizer}: the tokenizer has no EOS piece, which separates documents")
    token_dtype = resolve_dtype(dtype, vocab_size, tokenizer)
    return {"path": str(tokenizer), "sha256": file_sha256(tokenizer), "vocab_size": vocab_size,
            "bos_id": processor.bos_id(), "eos_id": processor.eos_id(), "dtype": token_dtype.name}


def resolve_dtype(dtype: str, vocab_size: int, tokenizer: Path | str = "tokenizer") -> np.dtype:
    """``auto`` -> uint16 below 65500 pieces else int32 (lit-gpt); an explicit dtype must hold
    every id ``< vocab_size``, else ValueError naming the tokenizer."""
    if dtype == "auto":
        return token_dtype_for_vocab(vocab_size)
    chosen = np.dtype(dtype)
    if chosen not in CODE_OF_DTYPE or chosen.kind not in "iu":
        raise ValueError(f"--dtype: {dtype} is not an integer dtype of the shard format")
    if vocab_size - 1 > np.iinfo(chosen).max:
        raise ValueError(
            f"{tokenizer}: vocabulary of {vocab_size} pieces does not fit {chosen.name} tokens "
            f"(largest id {np.iinfo(chosen).max}); use --dtype auto or a wider type"
        )
    return chosen


def _fingerprint(inputs: list[dict], tokenizer: dict, settings: dict) -> str:
    # Everything that changes the bytes of the output, and nothing else (not --workers).
    payload = {"inputs": [[i["path"], i["size"], i["mtime_ns"], i["split"]] for i in inputs],
               "tokenizer_sha256": tokenizer["sha256"], "settings": settings}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _our_files(output: Path) -> list[Path]:
    found = [output / n for n in (JOURNAL_NAME, MANIFEST_NAME) if (output / n).exists()]
    for name in (JOURNAL_NAME, MANIFEST_NAME):  # temporary files of atomic writes cut short
        found += sorted(output.glob(f"{name}.*.tmp"))
    for split in SPLITS:
        found += sorted(output.glob(f"{split}_*.bin")) + sorted(output.glob(f"{split}_*.bin.partial"))
    return found


def _listed_shards(path: Path, manifest: dict) -> dict[str, list[tuple[str, int]]]:
    """``{split: [(shard name, tokens), ...]}`` as manifest ``path`` lists them; ValueError naming the
    manifest when its shard lists or token totals are missing or malformed."""
    try:
        listed = {split: [(shard["name"], shard["tokens"]) for shard in manifest["shards"][split]] for split in SPLITS}
        totals = [manifest["tokens"][split] for split in SPLITS]
    except (KeyError, TypeError) as error:
        raise ValueError(f"{path}: damaged manifest (no shard list or token totals: {error!r})") from None
    if not all(isinstance(name, str) and "/" not in name and isinstance(count, int)
               for shards in listed.values() for name, count in shards) or not all(isinstance(t, int) for t in totals):
        raise ValueError(f"{path}: damaged manifest (a shard entry or token total of the wrong type)")
    return listed


def check_finished(output: str | os.PathLike, manifest: dict) -> None:
    """Check a finished output against its ``manifest``: every listed shard present, whole, with the
    token count listed; each split's listed counts adding up to the manifest's total; no shard (or
    unfinished ``.partial`` one) that the manifest does not list, which a loader would read too.
    ValueError naming the manifest and the first thing that differs."""
    output = Path(output)
    path = output / MANIFEST_NAME
    listed = _listed_shards(path, manifest)
    for split in SPLITS:
        held = 0
        for name, count in listed[split]:
            shard = shard_path_in(output, name, path)
            if not shard.is_file():
                raise ValueError(f"{shard}: listed in {path} but missing")
            tokens = read_header(shard)[1]  # also checks that the size matches the header's count
            if tokens != count:
                raise ValueError(f"{shard}: holds {tokens:,} tokens, {path} lists {count:,}")
            held += tokens
        claimed = manifest["tokens"][split]
        if held != claimed:
            raise ValueError(f"{path}: claims {claimed:,} {split} tokens, its shards hold {held:,}")
        names = {name for name, _ in listed[split]}
        strays = [p for p in sorted(output.glob(f"{split}_*.bin")) + sorted(output.glob(f"{split}_*.bin.partial"))
                  if p.name not in names]
        if strays:
            raise ValueError(f"{strays[0]}: a shard that {path} does not list (left by another run?)")


def _manifest_complete(output: Path, fingerprint: str) -> dict | None:
    """The manifest of a finished output of this job, checked against its shards (None when there is
    none); ValueError naming the manifest when it is damaged or does not match, or belongs to another job."""
    manifest = read_manifest(output)  # a manifest that is not JSON is named
    if manifest is None:
        return None
    path = output / MANIFEST_NAME
    _listed_shards(path, manifest)
    if manifest.get("fingerprint") != fingerprint:
        raise ValueError(
            f"{output}: holds a finished dataset made from other inputs, tokenizer or settings; "
            "use another --output or --overwrite"
        )
    try:
        check_finished(output, manifest)
    except ValueError as error:
        raise ValueError(f"{error}; the output is not the dataset its manifest describes: rerun with --overwrite "
                         "to make it again") from None
    return manifest


@dataclass
class Plan:
    """Everything that fixes the output bytes: the work units in order, the tokenizer, the settings."""

    units: list[WorkUnit]
    inputs: list[dict]
    tokenizer: dict
    settings: dict
    fingerprint: str

    @property
    def token_dtype(self) -> np.dtype:
        return np.dtype(self.tokenizer["dtype"])


def plan_job(inputs: Sequence[str], tokenizer: str | os.PathLike, val_fraction: float | None = None,
             shard_tokens: int = 1 << 27, dtype: str = "auto", text_key: str = "text",
             val_inputs: Sequence[str] = ()) -> Plan:
    """Check the arguments, the tokenizer and every input's schema, and cut the inputs into units.

    ``val_fraction`` None means 0.0005 without ``val_inputs`` and 0 with them.
    """
    if val_fraction is None:
        val_fraction = 0.0 if val_inputs else 0.0005
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val_fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ValueError(f"--shard_tokens must be >= 1, got {shard_tokens}")
    tokenizer_info = load_tokenizer_info(Path(tokenizer).resolve(), dtype)
    train_paths = expand_inputs(inputs)
    val_paths = expand_inputs(val_inputs, flag="--val_input") if val_inputs else []
    both = sorted(set(train_paths) & set(val_paths))
    if both:
        raise ValueError(f"{both[0]}: matched by both --input and --val_input; a held-out file must not "
                         "also be trained on")
    units: list[WorkUnit] = []
    input_info = []
    for path, split in [(p, None) for p in train_paths] + [(p, "val") for p in val_paths]:
        file_units = plan_units(path, text_key, split=split)
        stat = path.stat()
        input_info.append({"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                           "kind": input_kind(path)[0], "units": len(file_units),
                           "split": split or ("train and val by hash" if val_fraction > 0 else "train")})
        units += file_units
    settings = {"format_version": FORMAT_VERSION, "val_fraction": val_fraction, "shard_tokens": shard_tokens,
                "dtype": tokenizer_info["dtype"], "text_key": text_key, "bos": False, "eos": True,
                "jsonl_unit_bytes": JSONL_UNIT_BYTES, "parquet_unit_rows": PARQUET_UNIT_ROWS,
                "split": "validation iff blake2b(text, digest_size=8) as little-endian uint64 < val_fraction * 2**64; "
                         "every document of a --val_input file"}
    return Plan(units, input_info, tokenizer_info, settings, _fingerprint(input_info, tokenizer_info, settings))


def _open_journal(output: Path, plan: Plan, overwrite: bool) -> dict:
    """The journal of this job in ``output``: resumed, or new (after checking that the directory
    holds no other job's shards)."""
    if overwrite:
        for path in _our_files(output):
            path.unlink()
    journal_path = output / JOURNAL_NAME
    if journal_path.exists():
        journal = _read_journal(journal_path)
        if journal.get("fingerprint") != plan.fingerprint:
            raise ValueError(
                f"{journal_path}: an unfinished job with other inputs, tokenizer or settings (inputs changed "
                "size or mtime?); rerun that job, or use another --output or --overwrite"
            )
        return journal
    leftovers = _our_files(output)
    if leftovers:
        raise ValueError(f"{output}: holds shards not made by this job ({leftovers[0].name}, ...); "
                         "use another --output or --overwrite")
    journal = {"fingerprint": plan.fingerprint, "units_done": 0, "stats": _empty_stats(),
               "splits": {split: {"shards": [], "partial_tokens": 0} for split in SPLITS}}
    # Written before the first shard byte, so that a crash at any point later leaves a journal that
    # claims the output directory and says how much of it to keep.
    write_json_atomic(journal_path, journal)
    return journal


def _read_journal(path: Path) -> dict:
    """The journal of an unfinished job; ValueError naming it when it is damaged (it is always written
    atomically, so only something else can have damaged it)."""
    try:
        journal = json.loads(path.read_text(encoding="utf-8"))
        ok = (isinstance(journal, dict) and isinstance(journal.get("units_done"), int)
              and isinstance(journal.get("stats"), dict)
              and all(isinstance(journal["splits"][split]["shards"], list) for split in SPLITS))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: damaged journal ({error}); rerun with --overwrite to start again") from None
    if not ok:
        raise ValueError(f"{path}: damaged journal (missing fields); rerun with --overwrite to start again")
    return journal


def _unit_tasks(plan: Plan, start: int, tmp_dir: Path, stack: contextlib.ExitStack) -> Iterator[tuple]:
    """The ``encode_unit`` arguments of units ``start, start + 1, ...``; the ranges of compressed
    files are read here, in order, so each stream is decompressed once."""
    cursor = _StreamCursor()
    stack.callback(cursor.close)
    for i in range(start, len(plan.units)):
        unit = plan.units[i]
        data = cursor.read(unit) if unit.compression is not None and unit.end != -1 else None
        yield (unit, str(tmp_dir / f"unit_{i:09d}"), plan.settings["text_key"], plan.settings["val_fraction"],
               plan.settings["dtype"], plan.tokenizer["eos_id"], data)


def _unit_results(plan: Plan, start: int, tmp_dir: Path, processes: int, stack: contextlib.ExitStack) -> Iterator[dict]:
    """Counters of units ``start, start + 1, ...`` in order, their tokens waiting in ``tmp_dir``."""
    tokenizer_path = plan.tokenizer["path"]
    tasks = _unit_tasks(plan, start, tmp_dir, stack)
    if processes == 1:
        _init_worker(tokenizer_path)
        return map(_encode_unit_task, tasks)
    # spawn, not fork: the parent may hold pyarrow or torch thread pools that fork would break. The workers
    # start with Ctrl-C ignored (an ignored signal stays ignored across exec), so none is interrupted before
    # its initializer has said so itself.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
    try:
        pool = mp.get_context("spawn").Pool(processes, initializer=_init_pool_worker, initargs=(tokenizer_path,))
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
    stack.callback(pool.join)
    stack.callback(pool.terminate)
    return _ordered_bounded(pool, tasks, in_flight=2 * processes)


def prepare(inputs: Sequence[str], tokenizer: str | os.PathLike, output: str | os.PathLike, workers: int | None = None,
            val_fraction: float | None = None, shard_tokens: int = 1 << 27, dtype: str = "auto", text_key: str = "text",
            time_limit: float | None = None, overwrite: bool = False, progress: bool = True,
            val_inputs: Sequence[str] = (), on_unit: Callable[[int, WorkUnit, dict], None] | None = None
            ) -> dict | None:
    """Tokenise ``inputs`` (glob patterns) into packed shards in ``output``; every document of
    ``val_inputs`` goes to validation (``val_fraction``: see :func:`plan_job`).

    Returns the manifest (a dict, also written to ``output/manifest.json``) when the job is
    complete, or None when ``time_limit`` seconds passed first (progress is kept: call again).
    ``on_unit(index, unit, counters)`` is called as each work unit is committed (counters include
    the ``pid`` of the process that tokenised it).
    Worker processes are spawned, so they import the caller's ``__main__`` module: keep heavy
    imports of a calling script under ``if __name__ == "__main__"``.
    ``output`` is locked for the call: ValueError naming the folder and the holder when another run holds
    it. Interrupted (KeyboardInterrupt, or :class:`gdn2.commandline.Stopped`), it ends its workers and
    raises :class:`Stopped` saying how many units are kept.
    """
    workers = workers or len(os.sched_getaffinity(0))
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    plan = plan_job(inputs, tokenizer, val_fraction, shard_tokens, dtype, text_key, val_inputs)
    output = Path(output)
    lock = FolderLock(output, LOCK_NAME)
    holder = lock.acquire()
    if holder is not None:
        raise ValueError(f"--output: {output} is in use by another prepare run ({holder}); wait for it to finish, "
                         "or use another --output")
    try:
        return _prepare_locked(plan, output, workers, shard_tokens, time_limit, overwrite, progress, on_unit)
    finally:
        lock.release()


def _prepare_locked(plan: Plan, output: Path, workers: int, shard_tokens: int, time_limit: float | None,
                    overwrite: bool, progress: bool, on_unit: Callable[[int, WorkUnit, dict], None] | None
                    ) -> dict | None:
    """:func:`prepare` once it holds the lock on ``output``."""
    for stale in _our_files(output):  # temporary files of a run that died mid-write: nobody else writes here
        if stale.name.endswith(".tmp"):
            stale.unlink()
    if not overwrite:
        done = _manifest_complete(output, plan.fingerprint)
        if done is not None:
            (output / JOURNAL_NAME).unlink(missing_ok=True)  # left by a crash right after the manifest was written
            if progress:
                print(f"{output}: already complete ({MANIFEST_NAME} matches these inputs and settings)",
                      file=sys.stderr)
            _warn_if_no_validation(output, done)
            return done
    journal = _open_journal(output, plan, overwrite)
    stats, start = journal["stats"], journal["units_done"]
    writers = {split: ShardWriter(output, split, plan.token_dtype, shard_tokens, journal["splits"][split]["shards"],
                                  journal["splits"][split]["partial_tokens"]) for split in SPLITS}
    processes = 1 if len(plan.units) - start <= 1 else min(workers, len(plan.units) - start)
    tmp_dir = output / TMP_DIR_NAME
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    bar = None
    if progress:
        from tqdm import tqdm

        total_rows = sum(u.rows for u in plan.units) if all(u.kind == "parquet" for u in plan.units) else None
        bar = tqdm(total=total_rows, initial=stats["documents_read"], unit="doc", unit_scale=True,
                   dynamic_ncols=True, desc=f"tokenising ({processes} process{'es' if processes > 1 else ''})", smoothing=0.05)
    try:
        stopped = _tokenise(plan, output, journal, writers, tmp_dir, processes, bar, on_unit, time_limit)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM under sigterm_stops: the pool is ended by now
        signum = getattr(stop, "signum", signal.SIGINT)
        kept = _read_journal(output / JOURNAL_NAME)["units_done"]  # the file, which the stop may have beaten
        raise Stopped(f"{output}: stopped by {signal.Signals(signum).name} after {kept} of {len(plan.units)} work "
                      "units; rerun the same command to continue", signum) from None
    if stopped:
        return None

    kept = stats["documents_kept"]
    if kept["train"] + kept["val"] == 0:
        for writer in writers.values():
            writer.finish()
        (output / JOURNAL_NAME).unlink(missing_ok=True)
        raise ValueError(f"--input: no usable document in {', '.join(i['path'] for i in plan.inputs)} "
                         f"({stats['documents_read']} read, skipped: {dict(stats['documents_skipped'])}); "
                         "nothing was written")
    for writer in writers.values():
        writer.finish()
    manifest = {
        "format": "lit-gpt packed shards: 24-byte header (b'LITPKDS', uint64 version 1, uint8 dtype code, "
                  "uint64 token count), then the tokens",
        "fingerprint": plan.fingerprint,
        "inputs": plan.inputs,
        "work_units": len(plan.units),
        "tokenizer": plan.tokenizer,
        "settings": plan.settings,
        "shards": {split: [{"name": shard_name(split, i), "tokens": count} for i, count in enumerate(w.shards)]
                   for split, w in writers.items()},
        "documents": {"read": stats["documents_read"], "kept": stats["documents_kept"],
                      "skipped": stats["documents_skipped"], "skipped_examples": stats["skipped_examples"]},
        "tokens": stats["tokens"],
    }
    write_json_atomic(output / MANIFEST_NAME, manifest)
    (output / JOURNAL_NAME).unlink()
    fsync_dir(output)
    if progress:
        kept = manifest["documents"]["kept"]
        print(f"{output}: {manifest['tokens']['train']:,} train tokens in {len(writers['train'].shards)} shards, "
              f"{manifest['tokens']['val']:,} val tokens in {len(writers['val'].shards)}; documents kept "
              f"{kept['train'] + kept['val']:,}, skipped {dict(stats['documents_skipped'])}", file=sys.stderr)
    _warn_if_no_validation(output, manifest)
    return manifest


def _tokenise(plan: Plan, output: Path, journal: dict, writers: dict[str, "ShardWriter"], tmp_dir: Path,
              processes: int, bar, on_unit: Callable[[int, WorkUnit, dict], None] | None,
              time_limit: float | None) -> bool:
    """Tokenise the units the journal has not done yet, committing each to the shards and the journal in
    order; True when ``time_limit`` stopped it first. Whatever ends it, the workers are ended and the
    temporary folder removed on the way out."""
    stats, start = journal["stats"], journal["units_done"]
    started = time.monotonic()
    tokens_this_run = 0
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp_dir, ignore_errors=True)
        for writer in writers.values():
            stack.callback(writer.close)
        if bar is not None:
            stack.callback(bar.close)
        for index, unit_stats in enumerate(_unit_results(plan, start, tmp_dir, processes, stack), start=start):
            for split in SPLITS:
                part = tmp_dir / f"unit_{index:09d}.{split}"
                writers[split].append_file(part)
                part.unlink()
                writers[split].sync()
            _add_stats(stats, unit_stats)
            if on_unit is not None:
                on_unit(index, plan.units[index], unit_stats)
            journal["units_done"] = index + 1
            journal["splits"] = {split: {"shards": w.shards, "partial_tokens": w.partial_tokens}
                                 for split, w in writers.items()}
            write_json_atomic(output / JOURNAL_NAME, journal)
            tokens_this_run += sum(unit_stats["tokens"].values())
            if bar is not None:
                bar.update(unit_stats["documents_read"])
                rate = tokens_this_run / max(time.monotonic() - started, 1e-9)
                bar.set_postfix_str(f"{rate / 1e6:.2f}M tok/s, {stats['tokens']['train'] / 1e9:.3f}B train tokens")
            if time_limit is not None and time.monotonic() - started >= time_limit and index + 1 < len(plan.units):
                print(f"{output}: stopped after {index + 1} of {len(plan.units)} work units (--time_limit); "
                      "rerun the same command to continue", file=sys.stderr)
                return True
    return False


def _warn_if_no_validation(output: Path, manifest: dict) -> None:
    """An empty validation split is said on stderr (also with --quiet): the shards are complete and
    usable with another validation source, but the trainer's default ``data.val`` is this folder and
    would find no ``val_*.bin``."""
    if manifest["tokens"]["val"]:
        return
    documents = manifest["documents"]["kept"]["train"]
    fraction = manifest["settings"]["val_fraction"]
    enough = min(0.1, float(f"{max(100 / max(documents, 1), 1e-4):.0e}"))  # about 100 held-out documents
    print(f"warning: {output}: the validation split is empty (0 val tokens: --val_fraction {fraction:g} of "
          f"{documents:,} documents chose none, and no --val_input), so training that validates on this folder "
          f"finds no val_*.bin; rerun with --overwrite and held-out files as --val_input, or a larger "
          f"--val_fraction (e.g. {enough:g})", file=sys.stderr)


def _ordered_bounded(pool, tasks: Iterator[tuple], in_flight: int) -> Iterator[dict]:
    """Results of ``tasks`` in submission order, keeping at most ``in_flight`` submitted, so a
    slow unit never lets finished ones pile up without bound."""
    pending: collections.deque = collections.deque()
    for task in tasks:
        pending.append(pool.apply_async(_encode_unit_task, (task,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


@dataclass(kw_only=True)
class PrepareOptions:
    input: list[str] = option(help="parquet / jsonl[.zst|.gz] file or glob (quote it); repeatable, order kept")
    tokenizer: str = option(help="SentencePiece .model file")
    output: str = option(help="output directory for shards and manifest.json")
    val_input: list[str] = option([], "held-out file or glob, repeatable: all its documents go to val_*.bin, none "
                                      "to training (then --val_fraction defaults to 0)")
    workers: Optional[int] = option(None, "tokeniser processes", meaning_of_null="all cores")
    val_fraction: Optional[float] = option(None, "share of --input documents for validation, chosen by a hash of "
                                                 "the text", meaning_of_null="0.0005; 0 with --val_input")
    shard_tokens: int = option(1 << 27, "tokens per shard")
    dtype: str = option("auto", "token type (auto: uint16 below 65500 pieces, else int32)",
                        choices=["auto", "uint8", "uint16", "int32", "int64"])
    text_key: str = option("text", "parquet column / JSON key holding the text")
    time_limit: Optional[float] = option(None, "stop cleanly after this many seconds (exit status 3); rerun to "
                                               "continue", meaning_of_null="no limit")
    overwrite: bool = option(False, "delete shards, journal and manifest already in --output first")
    quiet: bool = option(False, "no progress bar")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_options(PrepareOptions, list(argv or []), "gdn2 prepare", __doc__.split("\n\n")[0])
    if args is None:
        return 0
    with sigterm_stops():  # a terminated run ends its workers and keeps its journal, as after Ctrl-C
        manifest = prepare(args.input, args.tokenizer, args.output, workers=args.workers,
                           val_fraction=args.val_fraction, shard_tokens=args.shard_tokens, dtype=args.dtype,
                           text_key=args.text_key, time_limit=args.time_limit, overwrite=args.overwrite,
                           progress=not args.quiet, val_inputs=args.val_input)
    return 0 if manifest is not None else EXIT_INCOMPLETE


if __name__ == "__main__":  # in a checkout: python data_prep/prepare.py ... = python -m gdn2 prepare ...
    from gdn2.__main__ import run_script

    run_script("prepare")
