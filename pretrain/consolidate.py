"""Turn a training checkpoint (sharded or not) into one ``model.pt`` for evaluation and generation.

    python pretrain/consolidate.py CHECKPOINT [--output model.pt]

CHECKPOINT is a ``step-<N>`` folder or a folder of them (the newest complete one is used). The output
holds ``{"model": state_dict (fp32, bare parameter names), "config": model config dict, "step",
"tokens", "recipe"}``; ``GPT(Config.from_dict(d["config"])).load_state_dict(d["model"])`` restores it.
Runs in one process on CPU, whatever the number of ranks that wrote the checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: Optional[list[str]] = None) -> int:
    import torch

    from gdn2.train.checkpoint import consolidate_checkpoint, resolve_resume

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a step-<N> checkpoint folder, or a folder of them (newest is used)")
    parser.add_argument("--output", default=None, help="output file (default: <checkpoint>/model.pt)")
    args = parser.parse_args(argv)
    try:
        path = resolve_resume(args.checkpoint, Path(args.checkpoint))
        assert path is not None
        consolidated = consolidate_checkpoint(path)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    output = Path(args.output) if args.output else path / "model.pt"
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    torch.save(consolidated, tmp)
    tmp.replace(output)
    n = sum(t.numel() for t in consolidated["model"].values())
    print(f"wrote {output}: {n:,} parameters, step {consolidated['step']}, config {consolidated['config'].get('name')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
