"""``python pretrain/main.py ...`` = ``python -m gdn2 pretrain ...``, also from a checkout that is not
installed (the SLURM and local launchers call it)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gdn2.train.slurm import catch_early_signals  # noqa: E402

if __name__ == "__main__":
    catch_early_signals()  # before torch is imported: a SLURM signal during start-up is answered, not fatal
    from gdn2.commandline import run
    from gdn2.train.cli import main

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run(main, sys.argv[1:], "pretrain"))
