"""``python pretrain/main.py ...`` = ``python -m gdn2 pretrain ...``, also from a checkout that is not
installed (the SLURM and local launchers call it)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__":
    from gdn2.__main__ import main  # light: the command's own imports come after its signal catch

    sys.exit(main(["pretrain", *sys.argv[1:]]))
