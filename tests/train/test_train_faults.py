"""Faults that must neither lose nor corrupt a run: resuming an older checkpoint, damaged checkpoints,
a mistyped data folder, token ids beyond the vocabulary, two trainers on one run or checkpoint folder, a
trainer that finds the built-in corpus being built, a save that cannot use the temporary directory, a
full disk."""

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import gdn2.checkpoint.format as checkpoint
from gdn2.data.shards import PackedShardReader, write_shard
from gdn2.checkpoint.consolidate import main as consolidate_main
from gdn2.checkpoint.format import CorruptCheckpointError, list_checkpoints
from gdn2.commandline import run
from gdn2.files import FolderLock
from gdn2.train.loop import fit
from gdn2.train.metrics import read_jsonl
from gdn2.train.recipe import load_recipe
from train_helpers import ROOT, micro_config, read_state


def run_fit(cfg, out_dir, resume=None, **overrides):
    return fit(load_recipe(str(cfg), {k: str(v) for k, v in overrides.items()}, out_dir=str(out_dir)), resume=resume)


def losses(out):
    return {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"}


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.fixture
def saved_run(corpus, tmp_path):
    """A run of 6 steps with a checkpoint every 2 steps (2, 4, 6)."""
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=6), checkpoint=dict(interval=2, keep_last=5))
    out = tmp_path / "run"
    run_fit(cfg, out)
    return cfg, out


def test_resuming_an_older_checkpoint_makes_its_checkpoints_the_runs_own(saved_run):
    cfg, out = saved_run
    ckpts = out / "checkpoints"
    result = run_fit(cfg, out, resume=str(ckpts / "step-000000002"), **{"train.max_steps": 8})
    assert result.step == 8
    assert [s for s, _ in list_checkpoints(ckpts)] == [2, 4, 6, 8]
    (superseded,) = (ckpts / checkpoint.SUPERSEDED).iterdir()  # the old 4 and 6, kept, out of the way
    assert sorted(p.name for p in superseded.iterdir()) == ["step-000000004", "step-000000006"]
    # the new checkpoints hold the new trajectory: its step 4 is not the old run's step 4
    new4 = read_state(ckpts / "step-000000004")["trainer"]
    assert new4["step"] == 4
    assert checkpoint.read_marker(ckpts / "step-000000004")["saved_at"] > checkpoint.read_marker(
        superseded / "step-000000004")["saved_at"]
    assert sorted(losses(out)) == list(range(1, 9))
    assert run_fit(cfg, out, resume="auto", **{"train.max_steps": 9}).step == 9  # continues the new one


def test_a_flipped_bit_is_named_by_resume_and_consolidate(saved_run, capsys):
    cfg, out = saved_run
    newest = out / "checkpoints" / "step-000000006"
    (shard,) = (newest / "state").glob("*.distcp")  # the weights and optimizer state, one process's shards
    flip_a_byte(shard)
    with pytest.raises(CorruptCheckpointError, match=rf"step-000000006/state/{shard.name}: content differs"):
        run_fit(cfg, out, resume=str(newest), **{"train.max_steps": 8})
    with pytest.raises(CorruptCheckpointError, match=rf"step-000000006/state/{shard.name}: content differs"):
        consolidate_main([str(newest)])
    assert not (out / "final").exists()


def test_resume_refuses_a_forged_checkpoint_whose_checksums_were_resealed(saved_run, tmp_path):
    """The checksums catch damage, not forgery: a rank file that would run code when unpickled, with its
    digest recorded anew, is refused by --resume, naming it, and its code never runs."""
    cfg, out = saved_run
    newest = out / "checkpoints" / "step-000000006"
    ran = tmp_path / "code-ran"

    class RunsCode:
        def __reduce__(self):
            return exec, (f"open({str(ran)!r}, 'w').close()",)

    torch.save({"data": {}, "rng": RunsCode()}, newest / "ranks" / "rank-00000.pt")
    marker = checkpoint.read_marker(newest)
    marker["files"] = checkpoint.digest_files(newest)
    checkpoint.write_marker(newest, marker)
    with pytest.raises(ValueError, match=r"step-000000006/ranks/rank-00000.pt: refused to load: it asks for "
                                         r"builtins.exec"):
        run_fit(cfg, out, resume="auto", **{"train.max_steps": 8})
    assert not ran.exists()


def test_resume_auto_skips_a_damaged_or_incomplete_newest_checkpoint(saved_run, caplog):
    cfg, out = saved_run
    ckpts = out / "checkpoints"
    flip_a_byte(ckpts / "step-000000006" / "ranks" / "rank-00000.pt")
    (shard,) = (ckpts / "step-000000004" / "state").glob("*.distcp")
    shard.write_bytes(b"short")  # truncated
    with caplog.at_level(logging.INFO, logger="gdn2"):
        result = run_fit(cfg, out, resume="auto", **{"train.max_steps": 7})
    assert result.step == 7
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert len(skipped) == 2 and "rank-00000.pt: content differs" in skipped[0] and "truncated" in skipped[1]
    assert sorted(losses(out)) == list(range(1, 8))
    resumed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from")]
    assert "step-000000002" in resumed[0]


def test_mistyped_data_folder_is_not_filled_with_the_builtin_corpus(corpus, tmp_path):
    cfg = micro_config(corpus, tmp_path, data=dict(train=[str(tmp_path / "dta")], val=str(tmp_path / "dta"),
                                                   prepare_default=True))
    with pytest.raises(FileNotFoundError, match=r"dta holds no train_\*\.bin shards; data.prepare_default builds only"):
        run_fit(cfg, tmp_path / "run")
    assert not (tmp_path / "dta").exists()


def test_token_ids_beyond_the_vocabulary_name_the_data(corpus, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    tokens = np.arange(2000, dtype=np.uint16) % 300  # ids up to 299, the micro model has 256
    write_shard(bad / "train_0000000000.bin", tokens)
    write_shard(bad / "val_0000000000.bin", tokens[:500] % 256)
    cfg = micro_config(corpus, tmp_path, data=dict(train=[str(bad)], val=str(bad)))
    with pytest.raises(ValueError, match=r"data.train: .*train_0000000000.bin holds token id 299, not below "
                                         r"model.vocab_size 256"):
        run_fit(cfg, tmp_path / "run")
    (bad / "manifest.json").write_text(json.dumps({"tokenizer": {"vocab_size": 300}}))
    with pytest.raises(ValueError, match=r"300-piece tokenizer \(manifest.json\), but model.vocab_size is 256"):
        run_fit(cfg, tmp_path / "run2")


def test_a_validation_shard_beyond_the_vocabulary_is_named_before_the_first_step(corpus, tmp_path):
    """The manifest vouches for the vocabulary, but one id of the validation shard lies beyond it: named
    before training starts (it ended the run with an IndexError at its first validation)."""
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    tokens = PackedShardReader(data / "val_0000000000.bin").tokens.copy()
    tokens[100] = 300  # inside the first validation batch
    write_shard(data / "val_0000000000.bin", tokens)
    (data / "manifest.json").write_text(json.dumps({"tokenizer": {"vocab_size": 256}}))
    cfg = micro_config(corpus, tmp_path, data=dict(train=[str(data)], val=str(data)), eval=dict(interval=1),
                       checkpoint=dict(interval=1))
    with pytest.raises(ValueError, match=r"data.val: .*data/val_0000000000.bin: token id 300 at stream offset 100 is "
                                         r"outside the model's vocabulary of 256"):
        run_fit(cfg, tmp_path / "run")
    assert list_checkpoints(tmp_path / "run" / "checkpoints") == []  # (the folder holds only its lock)


@pytest.mark.slow
def test_a_second_trainer_on_the_same_folder_is_refused(corpus, tmp_path):
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=6))
    out = tmp_path / "run"
    lock = FolderLock(out)
    assert lock.acquire() is None
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "pretrain" / "main.py"), "--config", str(cfg), "--out_dir",
                               str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        lock.release()
    assert proc.returncode == 2
    assert "is in use by another trainer (pid" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (out / "metrics.jsonl").exists()
    assert run_fit(cfg, out).step == 6  # free again once the first one is gone


def test_save_writes_in_place_without_the_temporary_directory(corpus, tmp_path, monkeypatch):
    import tempfile

    def no_temporary_files(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (temporary directory)")

    for name in ("mkstemp", "NamedTemporaryFile", "TemporaryFile", "SpooledTemporaryFile", "mkdtemp"):
        monkeypatch.setattr(tempfile, name, no_temporary_files)
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=2), checkpoint=dict(interval=1))
    result = run_fit(cfg, tmp_path / "run")
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [1, 2] and result.step == 2


def test_a_second_trainer_sharing_the_checkpoint_folder_is_refused(corpus, tmp_path):
    shared = tmp_path / "shared_checkpoints"
    first = FolderLock(shared)  # what the trainer that uses it holds
    assert first.acquire() is None
    try:
        cfg = micro_config(corpus, tmp_path, train=dict(max_steps=2), checkpoint=dict(dir=str(shared), interval=1))
        with pytest.raises(ValueError, match=rf"{shared} is in use by another trainer \(pid {os.getpid()} on .*\); "
                                             r"wait for it to finish, or train with another --checkpoint.dir"):
            run_fit(cfg, tmp_path / "second_run", resume="auto")
    finally:
        first.release()
    assert list_checkpoints(shared) == [] and not (tmp_path / "second_run" / "metrics.jsonl").exists()


def test_a_full_disk_during_a_save_is_one_line_naming_the_disk_and_the_last_good_checkpoint(corpus, tmp_path,
                                                                                             small_disk, capsys):
    disk = small_disk("2500k")  # one checkpoint of the micro model (about 1.6 MB) fits, two do not
    cfg = micro_config(corpus, tmp_path, train=dict(max_steps=4),
                       checkpoint=dict(interval=2, keep_last=5, dir=str(disk / "checkpoints")))
    capsys.readouterr()
    assert run(lambda argv: run_fit(cfg, tmp_path / "run"), [], prog="gdn2 pretrain") == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert line.startswith(f"gdn2 pretrain: error: No space left on device while saving the checkpoint of step 4 in "
                           f"{disk / 'checkpoints'}: ")
    assert "free there of 2.4 MiB" in line
    assert line.endswith(f"last good checkpoint is {disk / 'checkpoints' / 'step-000000002'} (--debug shows the traceback)")
    assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == [".lock", "step-000000002"]  # no partial one


def test_a_damaged_consolidated_model_is_named_when_loaded(saved_run):
    from gdn2.checkpoint.load import load_model

    _, out = saved_run
    assert consolidate_main([str(out / "checkpoints")]) == 0
    assert (out / "final" / "model.pt.sha256").is_file()
    flip_a_byte(out / "final" / "model.pt")
    with pytest.raises(CorruptCheckpointError, match=r"final/model.pt: content differs from the sha256"):
        load_model(out / "final" / "model.pt")


def _read_lines_into(stream, lines: list) -> None:
    for line in stream:
        lines.append(line)


@pytest.mark.slow
def test_a_trainer_waits_for_the_builtin_corpus_another_process_is_building(corpus, tmp_path):
    """A trainer starting while another process builds ``data/default`` (a fresh clone, two jobs) waits for
    that build and takes its finished corpus: it neither builds beside it nor reads its half-made files."""
    import threading

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    builder = subprocess.Popen([sys.executable, "-m", "gdn2", "corpus", "--output", "data/default", "--vocab_size",
                                "512", "--max_bytes", "200000", "--workers", "1", "--quiet"], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock_file = tmp_path / "data" / "default" / ".corpus.lock"
    trainer = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and f"pid {builder.pid} " not in (
                lock_file.read_text() if lock_file.exists() else ""):
            time.sleep(0.01)
        os.kill(builder.pid, signal.SIGSTOP)  # holds the lock, its corpus unfinished
        cfg = micro_config(corpus, tmp_path, data=dict(train=["data/default"], val="data/default",
                                                       prepare_default=True))
        trainer = subprocess.Popen(
            [sys.executable, "-c", "from gdn2.train.recipe import load_recipe\n"
             "from gdn2.train.setup import prepare_default_corpus, setup_logging\n"
             f"setup_logging(0)\nprepare_default_corpus(load_recipe({str(cfg)!r}, {{}}, out_dir='run'))\n"],
            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
        said: list[str] = []
        threading.Thread(target=_read_lines_into, args=(trainer.stderr, said), daemon=True).start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("waiting for it to finish" in line for line in said):
            time.sleep(0.05)
        waiting = [line for line in said if "waiting for it to finish" in line]
        assert waiting and f"pid {builder.pid} on " in waiting[0], "".join(said)
        assert trainer.poll() is None  # still waiting
        os.kill(builder.pid, signal.SIGCONT)
        assert builder.wait(timeout=120) == 0, builder.stderr.read()
        assert trainer.wait(timeout=120) == 0, "".join(said)
    finally:
        for process in (builder, trainer):
            if process is not None and process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
                process.wait()
    assert any("data/default: already complete" in line for line in said), "".join(said)  # the builder's corpus
    from gdn2.data_prep.default_corpus import finished_corpus

    assert finished_corpus(tmp_path / "data" / "default")["tokenizer"]["vocab_size"] == 512
