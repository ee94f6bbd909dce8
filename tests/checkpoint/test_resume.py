"""gdn2/checkpoint/resume.py: which checkpoint --resume takes; incomplete ones refused, old ones pruned."""

import pytest

from checkpoint_helpers import make_fabric_model, save
from gdn2.checkpoint.format import MARKER, list_checkpoints
from gdn2.checkpoint.resume import prune_checkpoints, resolve_resume


def test_incomplete_checkpoint_is_refused(tmp_path):
    fabric, model, optimizer = make_fabric_model()
    root = tmp_path / "ckpt"
    path = save(fabric, model, optimizer, root, 3)
    (path / MARKER).unlink()
    assert resolve_resume("auto", root) is None
    with pytest.raises(ValueError, match="incomplete checkpoint"):
        resolve_resume(str(path), root)


def test_keep_last(tmp_path):
    fabric, model, optimizer = make_fabric_model()
    root = tmp_path / "ckpt"
    for step in range(1, 6):
        save(fabric, model, optimizer, root, step, keep_last=2)
    assert [s for s, _ in list_checkpoints(root)] == [4, 5]
    assert prune_checkpoints(root, 1) == [root / "step-000000004"]
