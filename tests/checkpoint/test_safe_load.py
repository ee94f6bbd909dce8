"""gdn2/checkpoint/safe_load.py: no file of a checkpoint runs code when it is loaded. Each file a forger can
write (a torch.distributed.checkpoint folder's metadata and its non-tensor entries, the trainer counters, a
rank's states, a one-file state) is refused, naming it, and what its pickle asked to run never runs; the
forger re-seals the checksums, which catch damage, not forgery."""

import pickle
import shutil

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from checkpoint_helpers import make_fabric_model, save, train_a_step
from gdn2.checkpoint.consolidate import main as consolidate_main
from gdn2.checkpoint.format import digest_files, read_marker, write_marker
from gdn2.checkpoint.safe_load import UnsafeFileError, read_dcp_metadata
from gdn2.checkpoint.state import load_checkpoint, quiet_single_process
from gdn2.commandline import run
from gdn2.train.fabric_api import unwrap


class RunsCode:
    """Unpickling this creates the file ``marker``: any code could run in its place."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def reseal(checkpoint):
    """What a forger does after changing a file: record its new size and sha256 in the marker."""
    marker = read_marker(checkpoint)
    marker["files"] = digest_files(checkpoint)
    write_marker(checkpoint, marker)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(fabric, model, optimizer, {"sharded": checkpoint, "full": checkpoint}) after one step."""
    root = tmp_path_factory.mktemp("saved")
    fabric, model, optimizer = make_fabric_model()
    train_a_step(model, optimizer)
    checkpoints = {"sharded": save(fabric, model, optimizer, root / "sharded", 1),
                   "full": save(fabric, model, optimizer, root / "full", 1, sharded=False)}
    return fabric, model, optimizer, checkpoints


def forge(kind, checkpoint, marker, model, optimizer):
    """Replace one file of ``checkpoint`` by a pickle that would create ``marker``; returns its path."""
    state = checkpoint / "state"
    if kind == "metadata":
        target = state / ".metadata"
        target.write_bytes(pickle.dumps(RunsCode(marker)))
    elif kind == "metadata path":  # only allowed classes, but a storage file outside the folder
        target = state / ".metadata"
        metadata = read_dcp_metadata(target)
        for info in metadata.storage_data.values():
            info.relative_path = "../../outside.distcp"
        target.write_bytes(pickle.dumps(metadata))
    elif kind == "distcp entry":  # a non-tensor entry (an optimizer hyper-parameter) of the shards
        import torch.distributed.checkpoint as dcp

        model_sd, optim_sd = get_state_dict(unwrap(model), unwrap(optimizer))
        optim_sd["param_groups"][0]["lr"] = RunsCode(marker)
        for shard in state.glob("*.distcp"):
            shard.unlink()
        with quiet_single_process():
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(state))
        (target,) = state.glob("*.distcp")
    elif kind == "meta.pt":
        target = state / "meta.pt"
        torch.save({"trainer": RunsCode(marker)}, target)
    elif kind == "rank file":
        target = checkpoint / "ranks" / "rank-00000.pt"
        torch.save({"data": {"n": 1}, "rng": RunsCode(marker)}, target)
    else:  # the one-file state of state_dict_type: full
        target = state
        torch.save({"model": {}, "optimizer": {}, "trainer": RunsCode(marker)}, target)
    reseal(checkpoint)
    return target


KINDS = {"metadata": "sharded", "metadata path": "sharded", "distcp entry": "sharded", "meta.pt": "sharded",
         "rank file": "sharded", "full state": "full"}


@pytest.mark.parametrize("kind", KINDS)
def test_a_forged_checkpoint_file_is_refused_on_resume_and_runs_nothing(saved, tmp_path, kind):
    fabric, model, optimizer, checkpoints = saved
    checkpoint = shutil.copytree(checkpoints[KINDS[kind]], tmp_path / "step-000000001")
    marker = tmp_path / "code-ran"
    target = forge(kind, checkpoint, marker, model, optimizer)
    refused = "is not a file of its folder" if kind == "metadata path" else "refused to load: it asks for builtins.exec"
    with pytest.raises(UnsafeFileError, match=rf"{target.name}.*{refused}") as caught:
        load_checkpoint(fabric, checkpoint, unwrap(model), unwrap(optimizer))
    assert str(target) in str(caught.value) and "\n" not in str(caught.value)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["metadata", "full state"])
def test_consolidate_refuses_a_forged_checkpoint_in_one_line(saved, tmp_path, capsys, kind):
    fabric, model, optimizer, checkpoints = saved
    checkpoint = shutil.copytree(checkpoints[KINDS[kind]], tmp_path / "step-000000001")
    marker = tmp_path / "code-ran"
    target = forge(kind, checkpoint, marker, model, optimizer)
    assert run(consolidate_main, [str(checkpoint), "--out", str(tmp_path / "final")], "gdn2 consolidate") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"gdn2 consolidate: error: {target}: refused to load: it asks for builtins.exec")
    assert not marker.exists() and not (tmp_path / "final").exists()


def test_a_forged_consolidated_model_is_refused_by_generate(tmp_path, capsys):
    from gdn2.generation.cli import main as generate_main

    marker = tmp_path / "code-ran"
    torch.save({"model": {}, "config": RunsCode(marker)}, tmp_path / "model.pt")
    assert run(generate_main, ["--checkpoint", str(tmp_path / "model.pt"), "--prompt", "x"], "gdn2 generate") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{tmp_path / 'model.pt'}: refused to load: it asks for builtins.exec" in line
    assert not marker.exists()
