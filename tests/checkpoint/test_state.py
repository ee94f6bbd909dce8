"""gdn2/checkpoint/state.py: atomic checkpoints with real Fabric on CPU, saved and restored exactly, also from
the earlier one-file format."""

import errno
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gdn2.checkpoint.state as checkpoint
from checkpoint_helpers import Boom, make_fabric_model, save, train_a_step
from gdn2.checkpoint.format import MARKER, list_checkpoints
from gdn2.checkpoint.resume import resolve_resume
from gdn2.checkpoint.state import CheckpointWriteError, load_checkpoint, rng_state, set_rng_state
from gdn2.train.fabric_api import unwrap


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "full"])
def test_save_load_roundtrip_and_resume_resolution(tmp_path, sharded):
    fabric, model, optimizer = make_fabric_model()
    root = tmp_path / "ckpt"
    assert resolve_resume("auto", root) is None
    train_a_step(model, optimizer)
    first = save(fabric, model, optimizer, root, 1, sharded=sharded)
    train_a_step(model, optimizer)
    second = save(fabric, model, optimizer, root, 2, sharded=sharded)
    assert [s for s, _ in list_checkpoints(root)] == [1, 2]
    assert resolve_resume("auto", root) == second
    assert resolve_resume(str(root), root) == second
    assert resolve_resume(str(first), root) == first
    marker = json.loads((second / MARKER).read_text())
    assert marker["step"] == 2 and marker["tokens"] == 20 and marker["world_size"] == 1

    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [optimizer.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    train_a_step(model, optimizer)  # move away, then restore
    trainer, extras = load_checkpoint(fabric, second, unwrap(model), unwrap(optimizer))
    assert trainer == {"step": 2} and extras == {"data": {"n": 2}}
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=0)
    for p, m in zip(model.parameters(), moments):
        torch.testing.assert_close(optimizer.state[p]["exp_avg_sq"], m, rtol=0, atol=0)


def test_crash_inside_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    fabric, model, optimizer = make_fabric_model()
    root = tmp_path / "ckpt"
    good = save(fabric, model, optimizer, root, 5)

    def crash(path, marker):
        raise Boom("disk went away")

    monkeypatch.setattr(checkpoint, "write_marker", crash)
    with pytest.raises(Boom):
        save(fabric, model, optimizer, root, 10)
    monkeypatch.undo()
    assert (root / ".step-000000010.tmp").is_dir()  # the half-written one stays under its temporary name
    assert resolve_resume("auto", root) == good
    with pytest.raises(ValueError, match="no complete checkpoint"):
        resolve_resume(str(tmp_path), root)
    # a later save of the same step replaces the leftovers, and pruning removes stale temporaries
    save(fabric, model, optimizer, root, 10)
    assert resolve_resume("auto", root).name == "step-000000010"
    assert not (root / ".step-000000010.tmp").exists()


def test_a_one_file_checkpoint_of_the_earlier_format_still_resumes_on_one_device(tmp_path):
    """Before one format served every strategy, one device wrote ``model.state_dict()`` and
    ``optimizer.state_dict()`` (state by parameter index) into one file: it still loads."""
    fabric, model, optimizer = make_fabric_model()
    train_a_step(model, optimizer)
    path = save(fabric, model, optimizer, tmp_path / "ckpt", 3, sharded=False)
    state = path / "state"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "trainer": {"step": 3}}, state)
    marker = json.loads((path / MARKER).read_text())
    del marker["files"]
    (path / MARKER).write_text(json.dumps(marker))
    expected = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    fresh_fabric, fresh, fresh_opt = make_fabric_model()
    trainer, _ = load_checkpoint(fresh_fabric, path, unwrap(fresh), unwrap(fresh_opt))
    assert trainer == {"step": 3}
    for a, b in zip(fresh.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for p, e in zip(fresh.parameters(), expected):
        torch.testing.assert_close(fresh_opt.state[p]["exp_avg"], e, rtol=0, atol=0)


# One checkpoint of the micro model with its optimizer moments (about 1.6 MB) fits, two do not.
DISK_FOR_ONE_CHECKPOINT = "2500k"


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "full"])
def test_a_full_disk_fails_the_save_naming_the_disk_and_the_last_good_checkpoint(small_disk, sharded):
    fabric, model, optimizer = make_fabric_model()
    train_a_step(model, optimizer)
    root = small_disk(DISK_FOR_ONE_CHECKPOINT)
    good = save(fabric, model, optimizer, root, 1, sharded=sharded, keep_last=5)
    with pytest.raises(CheckpointWriteError) as caught:
        save(fabric, model, optimizer, root, 2, sharded=sharded, keep_last=5)
    assert caught.value.errno == errno.ENOSPC
    assert re.fullmatch(rf"No space left on device while saving the checkpoint of step 2 in {root}: [\d.]+ K?i?B "
                        rf"free there of 2\.4 MiB; the partial checkpoint was removed\. The last good checkpoint is "
                        rf"{good}", str(caught.value))
    assert sorted(p.name for p in root.iterdir()) == ["step-000000001"]  # the partial one is gone
    assert resolve_resume("auto", root) == good


@pytest.mark.slow
def test_a_full_disk_on_two_ranks_fails_the_save_on_both_alike(small_disk, tmp_path):
    disks = {"sharded": small_disk(DISK_FOR_ONE_CHECKPOINT), "full": small_disk(DISK_FOR_ONE_CHECKPOINT)}
    report = tmp_path / "report"
    script = Path(__file__).with_name("full_disk_ranks.py")
    done = subprocess.run([sys.executable, str(script), str(disks["sharded"]), str(disks["full"]), str(report)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    ranks = [json.loads(Path(f"{report}.rank{r}.json").read_text()) for r in (0, 1)]
    for name, root in disks.items():
        outcomes = [rank[name] for rank in ranks]
        assert [outcome.pop("printed") for outcome in outcomes] == [True, False]  # rank 0 says it, once
        assert outcomes[0] == outcomes[1], name  # every rank saw the same save fail with the same message
        outcome = outcomes[0]
        assert outcome["saved"] == [1] and outcome["complete"] == [1] and outcome["error"]["errno"] == errno.ENOSPC
        message = outcome["error"]["message"]
        assert message.startswith(f"No space left on device while saving the checkpoint of step 2 in {root} (rank ")
        assert "free there of 2.4 MiB" in message
        assert message.endswith(f"The last good checkpoint is {root}/step-000000001")
        assert outcome["entries"] == ["step-000000001"]  # the partial one is gone


@pytest.mark.parametrize("form", ["current", "earlier"])
def test_rank_files_restore_every_random_state_through_the_safe_loader(tmp_path, form):
    """The RNG states come back exactly from a rank file read with weights_only=True: the current form
    (numpy's state as a tensor) and the earlier one (numpy's state tuple with its uint32 array)."""
    fabric, model, optimizer = make_fabric_model()
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # a cached Gaussian is part of numpy's state
    states = rng_state() if form == "current" else {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3))
    path = save(fabric, model, optimizer, tmp_path / "ckpt", 1)
    if form == "earlier":
        torch.save({"data": {"n": 1}, "rng": states}, path / "ranks" / "rank-00000.pt")
        marker = json.loads((path / MARKER).read_text())
        del marker["files"]
        (path / MARKER).write_text(json.dumps(marker))
    else:
        path = checkpoint.save_checkpoint(fabric, tmp_path / "ckpt", 2, {"model": unwrap(model),
                                          "optimizer": unwrap(optimizer), "trainer": {"step": 2}},
                                          {"rng": states}, "model: {}\n", {}, keep_last=3)
    _, extras = load_checkpoint(fabric, path, unwrap(model), unwrap(optimizer))
    set_rng_state(extras["rng"])
    assert (random.random(), np.random.standard_normal(3).tolist()) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])
