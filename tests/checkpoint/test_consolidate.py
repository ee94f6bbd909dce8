"""gdn2/checkpoint/consolidate.py: both state formats consolidate to the model's weights."""

import json

import torch
import yaml

from checkpoint_helpers import make_fabric_model, save, train_a_step
from gdn2.checkpoint.consolidate import consolidate_checkpoint
from gdn2.checkpoint.format import MARKER
from gdn2.config import Config
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
