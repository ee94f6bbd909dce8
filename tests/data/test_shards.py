"""The packed shard format: header, reader validation, shard discovery."""

import json
import re
import struct

import numpy as np
import pytest

from gdn2.data.shards import PackedShardReader, find_shards, read_manifest, token_dtype_for_vocab, write_shard
from gdn2.data.shards import HEADER_SIZE, pack_header


def test_header_layout_matches_litgpt_bytes(tmp_path):
    path = tmp_path / "train_0000000000.bin"
    tokens = np.array([5, 0, 65535, 7], dtype=np.uint16)
    write_shard(path, tokens)
    raw = path.read_bytes()
    assert HEADER_SIZE == 24 and len(raw) == 24 + 2 * 4
    assert raw[:7] == b"LITPKDS"
    assert struct.unpack("<Q", raw[7:15]) == (1,)
    assert raw[15] == 8  # uint16
    assert struct.unpack("<Q", raw[16:24]) == (4,)
    assert np.frombuffer(raw[24:], dtype="<u2").tolist() == [5, 0, 65535, 7]


@pytest.mark.parametrize("dtype, code", [(np.uint8, 1), (np.int8, 2), (np.int16, 3), (np.int32, 4),
                                         (np.int64, 5), (np.uint16, 8)])
def test_reader_round_trips_every_integer_dtype_code(tmp_path, dtype, code):
    path = tmp_path / "x.bin"
    tokens = np.arange(10).astype(dtype)
    write_shard(path, tokens)
    assert path.read_bytes()[15] == code
    reader = PackedShardReader(path)
    assert len(reader) == 10 and reader.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(reader.tokens, tokens)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_float_shard_is_refused_not_read_as_token_ids(tmp_path, dtype):
    """A header that says float32 with a size that fits it is self-consistent, but its values are not
    token ids: read as ids they were zeros and garbage, and training went on."""
    path = tmp_path / "train_0000000000.bin"
    values = np.linspace(0, 1, 50).astype(dtype)
    path.write_bytes(pack_header(dtype, len(values)) + values.tobytes())
    with pytest.raises(ValueError, match=rf"train_0000000000\.bin: header says {np.dtype(dtype)} values .* not "
                                         r"integer token ids"):
        PackedShardReader(path)
    with pytest.raises(ValueError, match="integer token ids"):
        write_shard(tmp_path / "b.bin", values)


def test_a_manifest_listing_a_shard_outside_its_folder_is_refused(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_shard(folder / "train_0000000000.bin", np.arange(5, dtype=np.uint16))
    manifest = {"shards": {"train": [{"name": "train_0000000000.bin", "tokens": 5}], "val": []}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert read_manifest(folder) == manifest
    for name in ("../../etc/hostname", "/etc/hostname", ".."):
        manifest["shards"]["val"] = [{"name": name, "tokens": 5}]
        (folder / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ValueError, match=rf"data/manifest.json: shard name '{re.escape(name)}' is not a file of "
                                             "its folder"):
            read_manifest(folder / "train_*.bin")


def test_empty_shard_reads_as_zero_tokens(tmp_path):
    path = tmp_path / "x.bin"
    write_shard(path, np.zeros(0, dtype=np.uint16))
    assert len(PackedShardReader(path)) == 0


def test_token_dtype_for_vocab():
    assert token_dtype_for_vocab(32000) == np.uint16
    assert token_dtype_for_vocab(65499) == np.uint16
    assert token_dtype_for_vocab(65500) == np.int32
    assert token_dtype_for_vocab(128256) == np.int32


def _good_shard(path, n=100):
    write_shard(path, np.arange(n, dtype=np.uint16))
    return bytearray(path.read_bytes())


def test_truncated_shard_names_the_file(tmp_path):
    path = tmp_path / "train_0000000003.bin"
    raw = _good_shard(path)
    path.write_bytes(raw[:-3])
    with pytest.raises(ValueError, match=r"train_0000000003\.bin.*truncated"):
        PackedShardReader(path)
    path.write_bytes(raw[:10])
    with pytest.raises(ValueError, match=r"train_0000000003\.bin.*shorter than"):
        PackedShardReader(path)


def test_trailing_bytes_are_rejected(tmp_path):
    path = tmp_path / "a.bin"
    raw = _good_shard(path)
    path.write_bytes(raw + b"\0\0")
    with pytest.raises(ValueError, match=r"a\.bin.*trailing"):
        PackedShardReader(path)


def test_wrong_magic_version_and_dtype_code(tmp_path):
    path = tmp_path / "a.bin"
    raw = _good_shard(path)
    bad = bytearray(raw)
    bad[:7] = b"NOTPKDS"
    path.write_bytes(bad)
    with pytest.raises(ValueError, match=r"a\.bin.*magic"):
        PackedShardReader(path)
    bad = bytearray(raw)
    bad[7:15] = struct.pack("<Q", 2)
    path.write_bytes(bad)
    with pytest.raises(ValueError, match=r"a\.bin.*version 2"):
        PackedShardReader(path)
    bad = bytearray(raw)
    bad[15] = 9
    path.write_bytes(bad)
    with pytest.raises(ValueError, match=r"a\.bin.*dtype code 9"):
        PackedShardReader(path)


def test_pack_header_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="dtype"):
        pack_header(np.uint32, 3)


def test_find_shards_directory_glob_and_missing(tmp_path):
    for name in ["train_0000000001.bin", "train_0000000000.bin", "val_0000000000.bin", "notes.txt"]:
        write_shard(tmp_path / name, np.arange(3, dtype=np.uint16))
    assert [p.name for p in find_shards(tmp_path)] == ["train_0000000000.bin", "train_0000000001.bin"]
    assert [p.name for p in find_shards(tmp_path, split="val")] == ["val_0000000000.bin"]
    assert [p.name for p in find_shards(str(tmp_path / "*_0000000000.bin"))] == [
        "train_0000000000.bin", "val_0000000000.bin"]
    with pytest.raises(FileNotFoundError, match=r"test_\*\.bin"):
        find_shards(tmp_path, split="test")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        find_shards(tmp_path / "nowhere" / "*.bin")
