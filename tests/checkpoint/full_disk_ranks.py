"""Two CPU ranks (Fabric DDP over gloo) save checkpoints onto small real disks until one is full; each
rank writes what it saw to ``<report>.rank<r>.json``. Run by tests/checkpoint/test_state.py:

    python tests/checkpoint/full_disk_ranks.py DISK_SHARDED DISK_FULL REPORT
"""

import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

from gdn2.checkpoint.format import list_checkpoints  # noqa: E402
from gdn2.checkpoint.state import CheckpointWriteError, save_checkpoint  # noqa: E402
from gdn2.config import Config  # noqa: E402
from gdn2.model import GPT  # noqa: E402
from gdn2.train.fabric_api import Fabric, unwrap  # noqa: E402
from train_helpers import MICRO_MODEL  # noqa: E402


def main(disk_sharded: str, disk_full: str, report: str) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", precision="32-true")
    fabric.launch()
    torch.manual_seed(0)
    model = GPT(Config(**MICRO_MODEL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    model(torch.randint(0, 256, (2, 16))).float().logsumexp(-1).mean().backward()
    optimizer.step()  # the optimizer holds its moments: a checkpoint the size a real one has
    seen = {}
    for name, root, sharded in (("sharded", Path(disk_sharded), True), ("full", Path(disk_full), False)):
        outcome = {"saved": []}
        for step in (1, 2, 3):
            state = {"model": unwrap(model), "optimizer": unwrap(optimizer), "trainer": {"step": step}}
            try:
                save_checkpoint(fabric, root, step, state, rank_state={"rank": fabric.global_rank},
                                config_yaml="model: {}\n", info={"tokens": step}, keep_last=5, sharded=sharded)
            except CheckpointWriteError as error:
                outcome["error"] = {"errno": error.errno, "message": str(error)}
                outcome["printed"] = not getattr(error, "told_elsewhere", False)  # by the command line
                break
            outcome["saved"].append(step)
        fabric.barrier()
        outcome["complete"] = [step for step, _ in list_checkpoints(root)]
        outcome["entries"] = sorted(p.name for p in root.iterdir())
        seen[name] = outcome
    Path(f"{report}.rank{fabric.global_rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:4])
