"""gdn2/checkpoint/consolidate.py: both state formats consolidate to the model's weights; the folder is
written whole (a crash or a full disk leaves the previous model as it was), with only the run's own
tokenizer."""

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from checkpoint_helpers import Boom, make_fabric_model, save, train_a_step
from gdn2.checkpoint.consolidate import consolidate_checkpoint, find_run_tokenizer, write_consolidated
from gdn2.checkpoint.consolidate import main as consolidate_main
from gdn2.checkpoint.format import MARKER, verify_consolidated
from gdn2.commandline import run
from gdn2.config import Config
from gdn2.files import file_sha256
from gdn2.model import GPT
from train_helpers import MICRO_MODEL


def test_consolidate_full_and_sharded_formats(tmp_path):
    """Both state formats (a torch.distributed.checkpoint folder, one file of full tensors) consolidate
    to the model's weights; a marker without checksums (as written before they were recorded) is accepted."""
    fabric, model, optimizer = make_fabric_model()
    train_a_step(model, optimizer)
    config_yaml = yaml.safe_dump({"model": Config(**MICRO_MODEL).to_dict()})
    sharded = save(fabric, model, optimizer, tmp_path / "sharded", 7, config_yaml=config_yaml)
    assert (sharded / "state").is_dir()
    path = save(fabric, model, optimizer, tmp_path / "full", 7, config_yaml=config_yaml, sharded=False)
    assert (path / "state").is_file()
    marker = json.loads((path / MARKER).read_text())
    del marker["files"]
    (path / MARKER).write_text(json.dumps(marker))
    full, from_dcp = consolidate_checkpoint(path), consolidate_checkpoint(sharded)
    assert full["step"] == 7 and full["tokens"] == 70 and full["config"]["n_layer"] == 2

    for d in (full, from_dcp):
        restored = GPT(Config.from_dict(d["config"]))
        restored.load_state_dict(d["model"])
        idx = torch.randint(0, 256, (1, 20))
        torch.testing.assert_close(restored(idx), model(idx), rtol=0, atol=0)


def consolidate_in_one_line(argv, capsys):
    """(exit status, the error line) of ``gdn2 consolidate ARGV``."""
    status = run(consolidate_main, [str(a) for a in argv], "gdn2 consolidate")
    return status, capsys.readouterr().err.strip()


def test_only_the_runs_own_tokenizer_is_copied(tmp_path):
    """A saved recipe or a manifest may name any file (here a private one): consolidation copies only the
    tokenizer whose sha256 the run recorded, and without a recorded digest never a file a config names."""
    data, secret = tmp_path / "data", tmp_path / "id_ed25519"
    data.mkdir()
    (data / "tokenizer.model").write_bytes(b"the run's tokenizer")
    secret.write_text("a private key")
    digest = file_sha256(data / "tokenizer.model")
    (data / "manifest.json").write_text(json.dumps({"tokenizer": {"path": str(secret), "sha256": digest}}))
    fabric, model, optimizer = make_fabric_model()
    config_yaml = yaml.safe_dump({"model": Config(**MICRO_MODEL).to_dict(),
                                  "data": {"train": [str(data)], "tokenizer": str(secret)}})
    checkpoint = save(fabric, model, optimizer, tmp_path / "ckpt", 1, config_yaml=config_yaml)
    out = tmp_path / "final"
    assert write_consolidated(checkpoint, out)["tokenizer"] == data / "tokenizer.model"
    assert (out / "tokenizer.model").read_bytes() == b"the run's tokenizer"
    assert torch.load(out / "model.pt", weights_only=True)["tokenizer_sha256"] == digest

    (data / "manifest.json").unlink()
    (data / "tokenizer.model").unlink()
    info = write_consolidated(checkpoint, out)
    assert info["tokenizer"] is None and sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.pt",
                                                                                "model.pt.sha256"]


def test_an_interrupted_move_into_place_keeps_the_old_model_whole(tmp_path, monkeypatch):
    """A crash after the new model is written but before it is in place (here: on a file system that cannot
    swap folders, the second of its two renames fails) leaves the previous model with its own digest."""
    import gdn2.files

    fabric, model, optimizer = make_fabric_model()
    config_yaml = yaml.safe_dump({"model": Config(**MICRO_MODEL).to_dict()})
    out = tmp_path / "final"
    write_consolidated(save(fabric, model, optimizer, tmp_path / "ckpt", 1, config_yaml=config_yaml), out)
    train_a_step(model, optimizer)
    second = save(fabric, model, optimizer, tmp_path / "ckpt", 2, config_yaml=config_yaml)

    monkeypatch.setattr(gdn2.files, "exchange_paths", lambda a, b: False, raising=False)
    crashed = []

    def crash_once(real):
        def rename(src, dst, *args, **kwargs):
            if Path(dst) in (out, out / "model.pt") and not crashed:
                crashed.append(dst)
                raise Boom("the power went out")
            return real(src, dst, *args, **kwargs)
        return rename

    monkeypatch.setattr(os, "rename", crash_once(os.rename))
    monkeypatch.setattr(os, "replace", crash_once(os.replace))
    with pytest.raises(Boom):
        write_consolidated(second, out)
    monkeypatch.undo()
    verify_consolidated(out / "model.pt")
    assert torch.load(out / "model.pt", weights_only=True)["step"] == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_full_disk_names_the_disk_and_the_last_good_model_and_leaves_nothing_partial(tmp_path, small_disk,
                                                                                        capsys):
    """On a real full disk (a tmpfs with room for one model): one line naming the disk and the model still
    in place, which is untouched, and no partial file."""
    disk = small_disk("800k")
    fabric, model, optimizer = make_fabric_model()
    config_yaml = yaml.safe_dump({"model": Config(**MICRO_MODEL).to_dict()})
    out = disk / "final"
    assert consolidate_in_one_line([save(fabric, model, optimizer, tmp_path / "ckpt", 1, config_yaml=config_yaml),
                                    "--out", out], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    train_a_step(model, optimizer)
    second = save(fabric, model, optimizer, tmp_path / "ckpt", 2, config_yaml=config_yaml)
    status, line = consolidate_in_one_line([second, "--out", out], capsys)
    assert status == 2 and len(line.splitlines()) == 1
    assert f"No space left on device on the disk mounted at {disk} while writing {out / 'model.pt'}" in line
    assert f"the last good model is {out / 'model.pt'}" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in disk.iterdir()] == ["final"]


def test_a_folder_of_other_files_is_not_replaced(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    fabric, model, optimizer = make_fabric_model()
    config_yaml = yaml.safe_dump({"model": Config(**MICRO_MODEL).to_dict()})
    checkpoint = save(fabric, model, optimizer, tmp_path / "ckpt", 1, config_yaml=config_yaml)
    status, line = consolidate_in_one_line([checkpoint, "--out", tmp_path / "mine"], capsys)
    assert status == 2 and "mine holds files that are not a consolidated model (notes.txt)" in line
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_a_tokenizer_path_that_leaves_its_folder_is_refused(tmp_path):
    """Relative paths that a manifest or a saved run config gives are relative to their folder and stay in it."""
    run_folder = tmp_path / "run"
    (run_folder / "data").mkdir(parents=True)
    (run_folder / "data" / "manifest.json").write_text(
        json.dumps({"tokenizer": {"path": "../../secret", "sha256": "0" * 64}}))
    with pytest.raises(ValueError, match=r"data/manifest.json: tokenizer.path: '../../secret' leaves its folder"):
        find_run_tokenizer({"data": {"train": ["data"]}}, [run_folder])
    with pytest.raises(ValueError, match=r"run config data.tokenizer: '../secret' leaves its folder"):
        find_run_tokenizer({"data": {"tokenizer": "../secret"}}, [run_folder], sha256="0" * 64)
