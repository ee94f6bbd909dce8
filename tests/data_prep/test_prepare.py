"""prepare.py: parquet / jsonl -> packed shards, exactness, determinism, resume, bad input."""

import gzip
import hashlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

import gdn2.data_prep.prepare as prep
from gdn2.data.loader import TrainLoader, ValLoader
from gdn2.data.shards import PackedShardReader

ROOT = Path(__file__).resolve().parents[2]
VAL_FRACTION = 0.1
SHARD_TOKENS = 1000

DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float32, 7: np.float64, 8: np.uint16}


def read_litpkds(path):
    """A reader written from the format description alone: struct + numpy.fromfile."""
    with open(path, "rb") as f:
        magic, version, code, count = struct.unpack("<7sQBQ", f.read(24))
        tokens = np.fromfile(f, dtype=np.dtype(DTYPES[code]).newbyteorder("<"))
    assert magic == b"LITPKDS" and version == 1
    assert len(tokens) == count, f"{path}: header count {count}, {len(tokens)} tokens in the file"
    return code, tokens


def expected_streams(documents, sp, val_fraction=VAL_FRACTION):
    streams = {"train": [], "val": []}
    for text in documents:
        h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
        split = "val" if h < val_fraction * 2**64 else "train"
        streams[split] += sp.encode(text) + [sp.eos_id()]
    return streams


def shard_files(directory):
    return {p.name: p.read_bytes() for p in sorted(Path(directory).glob("*.bin"))}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, make_documents, write_fineweb_parquet):
    """Three FineWeb-Edu parquet files of 80 documents in row groups of 30 (9 work units)."""
    root = tmp_path_factory.mktemp("corpus")
    documents = make_documents(240, seed=5)
    for i in range(3):
        write_fineweb_parquet(root / f"part_{i}.parquet", documents[80 * i:80 * (i + 1)], row_group_size=30)
    return root, documents


@pytest.fixture(scope="module")
def reference(corpus, tokenizer_model, tmp_path_factory):
    """The uninterrupted single-process run every other run must reproduce byte for byte."""
    root, _ = corpus
    out = tmp_path_factory.mktemp("reference")
    manifest = prep.prepare([str(root / "part_*.parquet")], tokenizer_model, out, workers=1,
                            val_fraction=VAL_FRACTION, shard_tokens=SHARD_TOKENS, progress=False)
    return out, manifest


def test_round_trip_parquet_to_shards(corpus, reference, sp):
    _, documents = corpus
    out, manifest = reference
    expected = expected_streams(documents, sp)
    assert len(expected["val"]) > 0 and len(expected["train"]) > 3 * SHARD_TOKENS
    for split in ("train", "val"):
        names = sorted(p.name for p in out.glob(f"{split}_*.bin"))
        assert names == [f"{split}_{i:010d}.bin" for i in range(len(names))]
        pieces = [read_litpkds(out / name) for name in names]
        assert all(code == 8 for code, _ in pieces)  # uint16 for a 600-piece vocabulary
        counts = [len(tokens) for _, tokens in pieces]
        assert all(c == SHARD_TOKENS for c in counts[:-1]) and 0 < counts[-1] <= SHARD_TOKENS
        stream = np.concatenate([tokens for _, tokens in pieces])
        assert stream.tolist() == expected[split]
        assert [s["tokens"] for s in manifest["shards"][split]] == counts
        assert manifest["tokens"][split] == len(expected[split])
        reader = PackedShardReader(out / names[0])
        assert reader.dtype == np.uint16 and np.array_equal(reader.tokens, pieces[0][1])
    docs = manifest["documents"]
    assert docs["read"] == 240 and docs["kept"]["train"] + docs["kept"]["val"] == 240
    assert sum(docs["skipped"].values()) == 0
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256(Path(manifest["tokenizer"]["path"]).read_bytes()).hexdigest()
    assert [Path(i["path"]).name for i in manifest["inputs"]] == ["part_0.parquet", "part_1.parquet", "part_2.parquet"]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert not (out / prep.JOURNAL_NAME).exists() and not list(out.glob("*.partial"))


def test_loaders_read_prepared_output(reference, sp):
    out, manifest = reference
    train = TrainLoader([(out, 1.0)], block_size=32, micro_batch_size=2, document_masking=True,
                        eos_id=sp.eos_id())
    batch = next(iter(train))
    assert batch["input_ids"].shape == (2, 32)
    val = ValLoader(out, block_size=32, micro_batch_size=2, num_batches=2)
    first = next(iter(val))["input_ids"][0].tolist()
    _, tokens = read_litpkds(out / "val_0000000000.bin")
    assert first == tokens[:32].tolist()


def test_workers_do_not_change_the_output(corpus, reference, tokenizer_model, tmp_path):
    root, _ = corpus
    prep.prepare([str(root / "part_*.parquet")], tokenizer_model, tmp_path, workers=2,
                 val_fraction=VAL_FRACTION, shard_tokens=SHARD_TOKENS, progress=False)
    assert shard_files(tmp_path) == shard_files(reference[0])
    assert (tmp_path / "manifest.json").read_text() == (reference[0] / "manifest.json").read_text().replace(
        str(reference[0]), str(tmp_path))


def test_resume_after_each_time_limit_stop(corpus, reference, tokenizer_model, tmp_path):
    root, _ = corpus
    runs = 0
    while True:
        runs += 1
        result = prep.prepare([str(root / "part_*.parquet")], tokenizer_model, tmp_path, workers=1,
                              val_fraction=VAL_FRACTION, shard_tokens=SHARD_TOKENS, time_limit=0, progress=False)
        if result is not None:
            break
        journal = json.loads((tmp_path / prep.JOURNAL_NAME).read_text())
        assert journal["units_done"] == runs  # one unit per run
    assert runs == 9
    assert shard_files(tmp_path) == shard_files(reference[0])


# Journal write 1 claims the directory; write k + 1 commits unit k (of 9).
@pytest.mark.parametrize("crash_at_commit, workers", [(1, 1), (2, 1), (5, 2), (10, 1)])
def test_resume_after_a_crash_between_shard_writes_and_journal(corpus, reference, tokenizer_model, tmp_path,
                                                              monkeypatch, crash_at_commit, workers):
    """The crash strikes after a unit's tokens reached the shards (closing some of them) but before
    its journal entry: the rerun must undo exactly that unit's writes and redo it."""
    root, _ = corpus
    real_write = prep.write_json_atomic
    commits = []

    def crashing_write(path, payload):
        if path.name == prep.JOURNAL_NAME:
            commits.append(path)
            if len(commits) == crash_at_commit:
                raise RuntimeError("simulated crash")
        real_write(path, payload)

    monkeypatch.setattr(prep, "write_json_atomic", crashing_write)
    with pytest.raises(RuntimeError, match="simulated crash"):
        prep.prepare([str(root / "part_*.parquet")], tokenizer_model, tmp_path, workers=workers,
                     val_fraction=VAL_FRACTION, shard_tokens=SHARD_TOKENS, progress=False)
    if crash_at_commit > 1:
        assert list(tmp_path.glob("*.bin.partial"))  # the crash left an open shard behind
    monkeypatch.setattr(prep, "write_json_atomic", real_write)
    prep.prepare([str(root / "part_*.parquet")], tokenizer_model, tmp_path, workers=workers,
                 val_fraction=VAL_FRACTION, shard_tokens=SHARD_TOKENS, progress=False)
    assert shard_files(tmp_path) == shard_files(reference[0])


def _hundred_unit_job(tmp_path, tokenizer_model, make_documents, write_fineweb_parquet):
    """(command line of a 2-worker ``gdn2 prepare`` of 100 work units into ``tmp_path/out``, its documents)."""
    documents = make_documents(400, seed=11)
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i in range(4):
        write_fineweb_parquet(inputs / f"p{i}.parquet", documents[100 * i:100 * (i + 1)], row_group_size=4)
    command = [sys.executable, "-m", "gdn2", "prepare", "--input", str(inputs / "*.parquet"),
               "--tokenizer", str(tokenizer_model), "--output", str(tmp_path / "out"), "--workers", "2",
               "--val-fraction", str(VAL_FRACTION), "--shard-tokens", str(SHARD_TOKENS), "--quiet"]
    return command, documents


def _units_done_reach(process, out, count, timeout=60.0):
    """Wait until the job's journal records ``count`` units done (or the process ends); the units done."""
    deadline = time.monotonic() + timeout
    units_done = 0
    while time.monotonic() < deadline and process.poll() is None:
        try:
            units_done = json.loads((out / prep.JOURNAL_NAME).read_text())["units_done"]
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if units_done >= count:
            break
        time.sleep(0.005)
    return units_done


def _assert_streams(out, documents, sp):
    expected = expected_streams(documents, sp)
    for split in ("train", "val"):
        stream = np.concatenate([read_litpkds(p)[1] for p in sorted(out.glob(f"{split}_*.bin"))])
        assert stream.tolist() == expected[split]


def test_resume_after_sigkill_of_the_cli(tokenizer_model, sp, tmp_path, make_documents, write_fineweb_parquet):
    command, documents = _hundred_unit_job(tmp_path, tokenizer_model, make_documents, write_fineweb_parquet)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    units_done = _units_done_reach(process, tmp_path / "out", 3)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert 3 <= units_done < 100, "the job was not interrupted mid-way"
    assert not (tmp_path / "out" / "manifest.json").exists()
    finished = subprocess.run(command, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    _assert_streams(tmp_path / "out", documents, sp)


@pytest.mark.slow
def test_ctrl_c_and_sigterm_stop_with_one_line_and_the_rerun_continues(tokenizer_model, sp, tmp_path, make_documents,
                                                                      write_fineweb_parquet):
    command, documents = _hundred_unit_job(tmp_path, tokenizer_model, make_documents, write_fineweb_parquet)
    out = tmp_path / "out"
    # Ctrl-C in a terminal: SIGINT to the whole process group, workers included; SIGTERM: to the job alone
    for signum, to_group, reached in ((signal.SIGINT, True, 3), (signal.SIGTERM, False, 6)):
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        units_done = _units_done_reach(process, out, reached)
        (os.killpg if to_group else os.kill)(process.pid, signum)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 128 + signum, stderr
        kept = json.loads((out / prep.JOURNAL_NAME).read_text())["units_done"]  # the journal is whole
        assert reached <= units_done <= kept < 100, "the job was not interrupted mid-way"
        assert stderr == (f"gdn2 prepare: {out}: stopped by {signal.Signals(signum).name} after {kept} of 100 work "
                          "units; rerun the same command to continue\n")  # and no worker's traceback
        assert not (out / prep.TMP_DIR_NAME).exists()
    finished = subprocess.run(command, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    _assert_streams(out, documents, sp)


def test_a_second_run_on_one_output_is_refused_naming_the_first(tokenizer_model, sp, tmp_path, make_documents,
                                                                 write_fineweb_parquet):
    command, documents = _hundred_unit_job(tmp_path, tokenizer_model, make_documents, write_fineweb_parquet)
    out = tmp_path / "out"
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _units_done_reach(first, out, 1) >= 1
        os.kill(first.pid, signal.SIGSTOP)  # mid-way, holding the lock
        second = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode == 2
    assert re.fullmatch(rf"gdn2 prepare: error: --output: {out} is in use by another prepare run \(pid {first.pid} on "
                        rf"{socket.gethostname()} since [-\d: ]+\); wait for it to finish, or use another --output "
                        r"\(--debug shows the traceback\)\n", second.stderr)
    assert first.wait(timeout=120) == 0, first.stderr.read()
    _assert_streams(out, documents, sp)  # the first run's output, untouched by the second


def test_a_rerun_on_a_finished_output_checks_its_shards_against_the_manifest(corpus, tokenizer_model, tmp_path):
    root, _ = corpus
    args = ([str(root / "part_0.parquet")], tokenizer_model, tmp_path)
    prep.prepare(*args, workers=1, shard_tokens=SHARD_TOKENS, progress=False)
    manifest_path = tmp_path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    held = manifest["tokens"]["train"]
    claims = dict(manifest, tokens=dict(manifest["tokens"], train=held + 1234))
    manifest_path.write_text(json.dumps(claims))
    with pytest.raises(ValueError, match=rf"manifest.json: claims {held + 1234:,} train tokens, its shards hold "
                                         rf"{held:,}; .* rerun with --overwrite"):
        prep.prepare(*args, workers=1, shard_tokens=SHARD_TOKENS, progress=False)
    manifest_path.write_text(json.dumps(manifest))
    stray = tmp_path / "train_0000000042.bin"
    stray.write_bytes((tmp_path / "train_0000000000.bin").read_bytes())  # a loader would read it too
    with pytest.raises(ValueError, match=r"train_0000000042.bin: a shard that .*manifest.json does not list"):
        prep.prepare(*args, workers=1, shard_tokens=SHARD_TOKENS, progress=False)
    stray.unlink()
    assert prep.prepare(*args, workers=1, shard_tokens=SHARD_TOKENS, progress=False) == manifest


def test_a_damaged_manifest_or_journal_is_one_line_naming_it(corpus, tokenizer_model, tmp_path, capsys):
    from gdn2.commandline import run

    root, _ = corpus
    argv = ["--input", str(root / "part_0.parquet"), "--tokenizer", str(tokenizer_model), "--output", str(tmp_path),
            "--workers", "1", "--shard_tokens", str(SHARD_TOKENS), "--quiet"]
    assert run(prep.main, argv, "gdn2 prepare") == 0
    manifest = tmp_path / "manifest.json"
    for damage, expected in ((b'{"fingerprint": "', "not a readable manifest"),
                             (b'{"fingerprint": "x", "tokens": 5}', "damaged manifest")):
        manifest.write_bytes(damage)
        capsys.readouterr()
        assert run(prep.main, argv, "gdn2 prepare") == 2
        assert capsys.readouterr().err.startswith(f"gdn2 prepare: error: {manifest}: {expected} (")
    manifest.unlink()
    (tmp_path / prep.JOURNAL_NAME).write_bytes(b"\x00\x00")  # as after a disk fault
    assert run(prep.main, argv, "gdn2 prepare") == 2
    assert capsys.readouterr().err.startswith(f"gdn2 prepare: error: {tmp_path / prep.JOURNAL_NAME}: damaged journal (")


def _write_jsonl(path, records, opener=open):
    with opener(path, "wb") as f:
        for record in records:
            f.write((json.dumps(record) + "\n").encode())


def test_jsonl_inputs_plain_zst_gz_and_byte_ranges_match_parquet(corpus, reference, tokenizer_model, tmp_path,
                                                                 monkeypatch):
    _, documents = corpus
    records = [{"text": t, "id": i} for i, t in enumerate(documents)]
    _write_jsonl(tmp_path / "a.jsonl", records[:100])
    _write_jsonl(tmp_path / "b.jsonl.zst", records[100:180],
                 opener=lambda p, m: zstandard.ZstdCompressor().stream_writer(open(p, m)))
    _write_jsonl(tmp_path / "c.jsonl.gz", records[180:], opener=gzip.open)
    monkeypatch.setattr(prep, "JSONL_UNIT_BYTES", 997)  # ~90 byte-range units, cut mid-line
    inputs = [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl.zst", "c.jsonl.gz")]
    manifest = prep.prepare(inputs, tokenizer_model, tmp_path / "out", workers=2, val_fraction=VAL_FRACTION,
                            shard_tokens=SHARD_TOKENS, progress=False)
    assert manifest["work_units"] > 50
    assert shard_files(tmp_path / "out") == shard_files(reference[0])


def test_bad_documents_are_skipped_and_counted(tokenizer_model, sp, tmp_path, make_documents,
                                               write_fineweb_parquet):
    good = make_documents(3, seed=8)
    # A string column smuggling invalid UTF-8 (parquet does not validate it on read).
    texts = [good[0], "", " \n\t ", None, b"\xff\xfe broken".decode("latin-1"), good[1]]
    raw = [t.encode("utf-8") if t is not None else None for t in texts]
    raw[4] = b"\xff\xfe broken"
    offsets = np.cumsum([0] + [len(r or b"") for r in raw]).astype(np.int32)
    validity = pa.array([r is not None for r in raw]).buffers()[1]
    column = pa.StringArray.from_buffers(len(raw), pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(r or b"" for r in raw)),
                                         null_bitmap=validity, null_count=1)
    pq.write_table(pa.table({"text": column, "id": [str(i) for i in range(6)]}), tmp_path / "a.parquet")
    write_fineweb_parquet(tmp_path / "b.parquet", [b"\x80bad", good[2].encode(), b""], text_type=pa.binary())
    lines = [json.dumps({"text": good[0]}).encode(), b'{"text": ""}', b"not json", b"[1, 2]", b'{"id": 3}',
             b'{"text": 5}', b'{"text": "lone \\ud800 surrogate"}', b'{"text": "\xff"}', b"", json.dumps({"text": good[1]}).encode()]
    (tmp_path / "c.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    manifest = prep.prepare([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet"), str(tmp_path / "c.jsonl")],
                            tokenizer_model, tmp_path / "out", workers=1, val_fraction=0.0, progress=False)
    docs = manifest["documents"]
    assert docs["skipped"] == {"empty": 4, "undecodable": 4, "missing_text": 3, "bad_json": 2}
    assert docs["kept"] == {"train": 5, "val": 0} and docs["read"] == 18
    examples = docs["skipped_examples"]
    assert any("a.parquet row 4" in e for e in examples["undecodable"])
    assert any("b.parquet row 0" in e for e in examples["undecodable"])
    assert any("c.jsonl" in e for e in examples["bad_json"])
    stream = np.concatenate([read_litpkds(p)[1] for p in sorted((tmp_path / "out").glob("train_*.bin"))])
    assert stream.tolist() == expected_streams([good[0], good[1], good[2], good[0], good[1]], sp, 0.0)["train"]
    assert not list((tmp_path / "out").glob("val_*.bin"))  # an empty split writes no shard


def test_parquet_without_text_column_names_the_file(tokenizer_model, tmp_path):
    pq.write_table(pa.table({"content": ["hello"], "id": ["1"]}), tmp_path / "no_text.parquet")
    with pytest.raises(ValueError, match=r"no_text\.parquet.*no column 'text'.*content"):
        prep.prepare([str(tmp_path / "no_text.parquet")], tokenizer_model, tmp_path / "out", progress=False)
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "int_text.parquet")
    with pytest.raises(ValueError, match=r"int_text\.parquet.*type int64"):
        prep.prepare([str(tmp_path / "int_text.parquet")], tokenizer_model, tmp_path / "out", progress=False)
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"notes\.csv.*unsupported"):
        prep.prepare([str(tmp_path / "notes.csv")], tokenizer_model, tmp_path / "out", progress=False)
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        prep.prepare([str(tmp_path / "nothing_here*.parquet")], tokenizer_model, tmp_path / "out", progress=False)


def test_vocabulary_too_large_for_the_dtype(tokenizer_model, corpus, tmp_path):
    root, _ = corpus
    with pytest.raises(ValueError, match=r"tok\.model.*600 pieces.*uint8"):
        prep.prepare([str(root / "part_0.parquet")], tokenizer_model, tmp_path, dtype="uint8", progress=False)
    with pytest.raises(ValueError, match=r"big\.model.*70000 pieces.*uint16"):
        prep.resolve_dtype("uint16", 70000, "big.model")
    assert prep.resolve_dtype("auto", 70000) == np.int32
    manifest = prep.prepare([str(root / "part_0.parquet")], tokenizer_model, tmp_path, dtype="int32",
                            shard_tokens=SHARD_TOKENS, progress=False)
    assert manifest["settings"]["dtype"] == "int32"
    assert read_litpkds(tmp_path / "train_0000000000.bin")[0] == 4


def test_finished_output_is_a_no_op_and_other_jobs_are_refused(corpus, tokenizer_model, tmp_path):
    root, _ = corpus
    args = ([str(root / "part_0.parquet")], tokenizer_model, tmp_path)
    first = prep.prepare(*args, workers=1, shard_tokens=SHARD_TOKENS, progress=False)
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.name != prep.LOCK_NAME}
    assert prep.prepare(*args, workers=1, shard_tokens=SHARD_TOKENS, progress=False) == first
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.name != prep.LOCK_NAME} == stamps
    with pytest.raises(ValueError, match="finished dataset"):
        prep.prepare(*args, shard_tokens=SHARD_TOKENS * 2, progress=False)
    again = prep.prepare(*args, shard_tokens=SHARD_TOKENS * 2, overwrite=True, progress=False)
    assert again["settings"]["shard_tokens"] == SHARD_TOKENS * 2
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "train_0000000000.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not made by this job"):
        prep.prepare(args[0], tokenizer_model, stranger, progress=False)


def test_cli_round_trip_and_exit_status(corpus, tokenizer_model, tmp_path):
    root, _ = corpus
    command = [sys.executable, "-m", "gdn2", "prepare", "--input", str(root / "part_1.parquet"),
               "--tokenizer", str(tokenizer_model), "--output", str(tmp_path), "--workers", "1",
               "--shard-tokens", "500", "--time-limit", "0"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    stopped = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert stopped.returncode == prep.EXIT_INCOMPLETE, stopped.stderr
    assert "rerun" in stopped.stderr
    done = subprocess.run(command[:-2], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "doc/s" in done.stderr and "tok/s" in done.stderr  # the progress bar
    assert json.loads((tmp_path / "manifest.json").read_text())["documents"]["read"] == 80


def test_large_compressed_file_is_shared_by_every_worker(corpus, tokenizer_model, tmp_path, monkeypatch):
    """One large .jsonl.zst beside small plain files: the large file is cut into ranges of whole
    lines that every worker takes part in, and the output does not depend on the worker count."""
    _, documents = corpus
    records = [{"text": t} for t in documents]
    _write_jsonl(tmp_path / "large.jsonl.zst", records[:200] * 3,
                 opener=lambda p, m: zstandard.ZstdCompressor().stream_writer(open(p, m)))
    for i in range(3):
        _write_jsonl(tmp_path / f"small_{i}.jsonl", records[200 + 10 * i:210 + 10 * i])
    monkeypatch.setattr(prep, "JSONL_UNIT_BYTES", 8192)
    inputs = [str(tmp_path / "large.jsonl.zst"), str(tmp_path / "small_*.jsonl")]
    workers_of = {}

    def run(workers, out):
        units = []
        manifest = prep.prepare(inputs, tokenizer_model, out, workers=workers, val_fraction=VAL_FRACTION,
                                shard_tokens=SHARD_TOKENS, progress=False,
                                on_unit=lambda i, unit, stats: units.append((unit, stats["pid"])))
        workers_of[workers] = {pid for unit, pid in units if unit.path.endswith("large.jsonl.zst")}
        return manifest, units

    manifest, units = run(3, tmp_path / "three")
    large_units = [u for u, _ in units if u.path.endswith("large.jsonl.zst")]
    assert len(large_units) >= 3 * 3 and manifest["inputs"][0]["units"] == len(large_units)
    assert len(workers_of[3]) == 3  # every worker tokenised part of the large file
    assert [u.start for u in large_units[1:]] == [u.end for u in large_units[:-1]]
    run(1, tmp_path / "one")
    assert shard_files(tmp_path / "three") == shard_files(tmp_path / "one")
    assert manifest["documents"]["read"] == 630


def test_parquet_row_groups_split_into_units(corpus, reference, tokenizer_model, tmp_path, monkeypatch):
    root, _ = corpus
    monkeypatch.setattr(prep, "PARQUET_UNIT_ROWS", 7)  # row groups of 30 rows -> 5 units each
    manifest = prep.prepare([str(root / "part_*.parquet")], tokenizer_model, tmp_path, workers=2,
                            val_fraction=VAL_FRACTION, shard_tokens=SHARD_TOKENS, progress=False)
    assert manifest["work_units"] == 3 * (5 + 5 + 3)  # 80 rows per file: row groups of 30, 30, 20
    assert shard_files(tmp_path) == shard_files(reference[0])


def test_val_input_goes_only_to_validation(corpus, tokenizer_model, sp, tmp_path):
    _, documents = corpus
    _write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in documents[:150]])
    _write_jsonl(tmp_path / "heldout.jsonl.zst", [{"text": t} for t in documents[150:]],
                 opener=lambda p, m: zstandard.ZstdCompressor().stream_writer(open(p, m)))
    manifest = prep.prepare([str(tmp_path / "train.jsonl")], tokenizer_model, tmp_path / "out", workers=2,
                            shard_tokens=SHARD_TOKENS, progress=False, val_inputs=[str(tmp_path / "heldout.jsonl.zst")])
    streams = {split: np.concatenate([read_litpkds(p)[1] for p in sorted((tmp_path / "out").glob(f"{split}_*.bin"))])
               for split in ("train", "val")}
    assert streams["train"].tolist() == expected_streams(documents[:150], sp, 0.0)["train"]
    assert streams["val"].tolist() == expected_streams(documents[150:], sp, 1.0)["val"]
    assert manifest["settings"]["val_fraction"] == 0.0
    assert [(Path(i["path"]).name, i["split"]) for i in manifest["inputs"]] == [("train.jsonl", "train"),
                                                                              ("heldout.jsonl.zst", "val")]
    with pytest.raises(ValueError, match=r"train\.jsonl: matched by both --input and --val_input"):
        prep.prepare([str(tmp_path / "*.jsonl")], tokenizer_model, tmp_path / "o2", progress=False,
                     val_inputs=[str(tmp_path / "train.jsonl")])
    with pytest.raises(FileNotFoundError, match="--val_input: no files match"):
        prep.prepare([str(tmp_path / "train.jsonl")], tokenizer_model, tmp_path / "o3", progress=False,
                     val_inputs=[str(tmp_path / "missing*.jsonl")])


def test_an_empty_validation_split_is_said_with_what_to_do(corpus, tokenizer_model, tmp_path, capsys):
    _, documents = corpus
    _write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in documents[:20]])
    manifest = prep.prepare([str(tmp_path / "train.jsonl")], tokenizer_model, tmp_path / "none", workers=1,
                            progress=False)  # the default --val_fraction 0.0005 picks none of 20 documents
    assert manifest["tokens"]["val"] == 0 and manifest["tokens"]["train"] > 0  # the shards are still written
    warning = capsys.readouterr().err
    assert warning.startswith(f"warning: {tmp_path / 'none'}: the validation split is empty"), warning
    assert "--val_input" in warning and "--val_fraction (e.g. 0.1)" in warning and len(warning.splitlines()) == 1
    prep.prepare([str(tmp_path / "train.jsonl")], tokenizer_model, tmp_path / "half", workers=1,
                 val_fraction=0.5, progress=False)
    assert capsys.readouterr().err == ""
