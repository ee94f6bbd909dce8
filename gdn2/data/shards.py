"""The packed shard format (byte-compatible with lit-gpt's ``PackedDataset``) and its reader.

A shard is a 24-byte header followed by the tokens in C order::

    offset  size  field
    0       7     magic  b"LITPKDS"
    7       8     version, uint64 little-endian, = 1
    15      1     dtype code, uint8 (see ``DTYPE_CODES``)
    16      8     token count, uint64 little-endian (lit-gpt calls it the chunk size)
    24      ...   count tokens of that dtype, little-endian

Files are named ``{prefix}_{counter:010d}.bin`` (``train_0000000000.bin``, ``val_0000000000.bin``...)
so that sorting the names sorts the shards in stream order.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"LITPKDS"
VERSION = 1
HEADER = struct.Struct("<7sQBQ")
HEADER_SIZE = HEADER.size  # 24
assert HEADER_SIZE == 24

# lit-gpt's codes; the numbering is part of the on-disk format.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float32),
    7: np.dtype(np.float64),
    8: np.dtype(np.uint16),
}
CODE_OF_DTYPE: dict[np.dtype, int] = {dtype: code for code, dtype in DTYPE_CODES.items()}
# Shards hold token ids: the float codes of the format are refused (a float32 shard read as ids would
# silently train on zeros and garbage).
TOKEN_DTYPE_CODES = frozenset(code for code, dtype in DTYPE_CODES.items() if dtype.kind in "iu")

# Written by data_prep/prepare.py beside the shards it makes.
MANIFEST_NAME = "manifest.json"

# lit-gpt switches to int32 at this vocabulary size (a little below 2**16, for no documented reason;
# we keep the threshold so that the same tokenizer gives the same files).
UINT16_VOCAB_LIMIT = 65500


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when ``vocab_size < 65500``, else int32 (the lit-gpt rule)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size < UINT16_VOCAB_LIMIT:
        return np.dtype(np.uint16)
    if vocab_size <= np.iinfo(np.int32).max:
        return np.dtype(np.int32)
    raise ValueError(f"vocab_size {vocab_size} does not fit in int32 tokens")


def pack_header(dtype: np.dtype | type, count: int) -> bytes:
    """The 24-byte header of a shard holding ``count`` tokens of ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype not in CODE_OF_DTYPE:
        raise ValueError(f"dtype {dtype} has no code in the packed shard format")
    if count < 0:
        raise ValueError(f"token count must be >= 0, got {count}")
    return HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[dtype], count)


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write ``tokens`` (1-D, an integer dtype of ``DTYPE_CODES``) as one shard at ``path``."""
    tokens = np.ascontiguousarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integer token ids, got {tokens.dtype}")
    with open(path, "wb") as f:
        f.write(pack_header(tokens.dtype, len(tokens)))
        f.write(tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes())


def read_header(path: str | os.PathLike) -> tuple[np.dtype, int]:
    """Validate the header and size of the shard at ``path``; returns ``(dtype, token count)``.

    Raises ValueError naming the file when the magic, version or dtype code is wrong, the dtype is not
    an integer one (token ids), or the file size is not exactly header + count * itemsize (a truncated
    or overlong shard).
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(HEADER_SIZE)
    if len(raw) < HEADER_SIZE:
        raise ValueError(f"{path}: {size} bytes, shorter than the {HEADER_SIZE}-byte shard header")
    magic, version, code, count = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ValueError(f"{path}: bad magic {magic!r}, expected {MAGIC!r} (not a packed shard)")
    if version != VERSION:
        raise ValueError(f"{path}: unsupported shard version {version}, expected {VERSION}")
    if code not in DTYPE_CODES:
        raise ValueError(f"{path}: unknown dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
    dtype = DTYPE_CODES[code]
    if code not in TOKEN_DTYPE_CODES:
        raise ValueError(f"{path}: header says {dtype} values (dtype code {code}), not integer token ids; a token "
                         f"shard holds one of {', '.join(str(DTYPE_CODES[c]) for c in sorted(TOKEN_DTYPE_CODES))}")
    expected = HEADER_SIZE + count * dtype.itemsize
    if size != expected:
        kind = "truncated" if size < expected else "has trailing bytes"
        raise ValueError(
            f"{path}: shard {kind}: header says {count} tokens of {dtype} ({expected} bytes), "
            f"file has {size} bytes"
        )
    return dtype, count


class PackedShardReader:
    """Read-only memory map of one packed shard.

    ``reader.tokens`` is a 1-D numpy memmap of ``len(reader)`` tokens of ``reader.dtype``
    (uint16 or int32 for token shards); nothing is read from disk until it is indexed.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.dtype, count = read_header(self.path)
        if count == 0:
            # numpy refuses to map zero bytes; an empty array behaves the same for readers.
            self.tokens = np.empty(0, dtype=self.dtype)
        else:
            self.tokens = np.memmap(
                self.path, dtype=self.dtype.newbyteorder("<"), mode="r", offset=HEADER_SIZE, shape=(count,)
            )

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"PackedShardReader({str(self.path)!r}, tokens={len(self)}, dtype={self.dtype})"


def find_shards(pattern_or_dir: str | os.PathLike, split: str = "train") -> list[Path]:
    """The shards of a stream, in stream order.

    A directory means ``{split}_*.bin`` inside it; anything else is a glob pattern used as is.
    Raises FileNotFoundError naming the pattern when nothing matches.
    """
    target = Path(pattern_or_dir).expanduser()
    if target.is_dir():
        pattern = str(target / f"{split}_*.bin")
    else:
        pattern = str(target)
    matches = sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_file())
    if not matches:
        raise FileNotFoundError(f"no shards match {pattern!r} (from {str(pattern_or_dir)!r}, split {split!r})")
    return matches


def shard_path(folder: str | os.PathLike, name: str, manifest: str | os.PathLike) -> Path:
    """``folder / name`` for a shard ``name`` listed in ``manifest``: ValueError naming the manifest unless
    the name is a plain file name of that folder (``../../etc/hostname`` is refused, not read)."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"{manifest}: shard name {name!r} is not a file of its folder {folder}; refused")
    return Path(folder) / name


def read_manifest(pattern_or_dir: str | os.PathLike) -> dict | None:
    """The ``manifest.json`` that ``prepare.py`` wrote beside the shards of a folder (or of the folder
    a glob pattern points into), or None when there is none. A manifest that is not JSON, or that lists
    a shard outside its folder (see :func:`shard_path`), is an error naming it."""
    target = Path(pattern_or_dir).expanduser()
    folder = target if target.is_dir() else target.parent
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable manifest ({error})") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: not a readable manifest (expected a JSON object)")
    shards = manifest.get("shards")
    for entries in (shards.values() if isinstance(shards, dict) else []):
        for entry in (entries if isinstance(entries, list) else []):
            shard_path(folder, entry.get("name") if isinstance(entry, dict) else entry, path)
    return manifest
