"""Pretrain a GDN-2 language model: ``python pretrain/main.py --config NAME [--section.key value ...]``.

Thin glue: parse the named config and the overrides (``gdn2.train.recipe``), then run the loop
(``gdn2.train.loop.fit``). ``--help`` lists every option.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

# Running as a script from a checkout without `pip install -e .` still finds the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

USAGE = """usage: python pretrain/main.py --config NAME|PATH.yaml [--section.key value ...]
                               [--resume auto|PATH] [--out_dir DIR] [--help]

  --config NAME       a named config (configs/NAME.yaml) or a YAML path; holds the model and the recipe
  --resume auto|PATH  auto: continue from the newest complete checkpoint of the run (start fresh if there
                      is none); PATH: a checkpoint folder (step-<N>) or a folder of checkpoints
  --out_dir DIR       run folder: config.yaml, metrics.jsonl, tensorboard/, checkpoints/ (default out/NAME)
  --section.key VALUE override one recipe value (also --section.key=VALUE); lists in YAML: [1, 2]
  --help              this text; with --config, the defaults shown are that config's values

options (section.key, type, default):"""


def parse_args(argv: list[str]) -> tuple[Optional[str], dict[str, str], Optional[str], Optional[str], bool]:
    """(config, overrides, resume, out_dir, help) from the command line; ValueError on bad syntax."""
    config = resume = out_dir = None
    overrides: dict[str, str] = {}
    want_help = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            want_help = True
            i += 1
            continue
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}; options look like --section.key value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"--{key} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        if key == "config":
            config = value
        elif key == "resume":
            resume = value
        elif key == "out_dir":
            out_dir = value
        elif "." in key:
            if key in overrides:
                raise ValueError(f"--{key} given twice")
            overrides[key] = value
        else:
            raise ValueError(f"unknown option --{key}; expected --config, --resume, --out_dir or --section.key")
    return config, overrides, resume, out_dir, want_help


def main(argv: Optional[list[str]] = None) -> int:
    from gdn2.train.recipe import load_recipe, options_help

    argv = sys.argv[1:] if argv is None else argv
    try:
        config, overrides, resume, out_dir, want_help = parse_args(argv)
        if want_help:
            recipe = load_recipe(config, overrides, out_dir) if config else None
            print(USAGE + options_help(recipe))
            return 0
        if config is None:
            raise ValueError("--config is required (a name from configs/ or a YAML path)")
        recipe = load_recipe(config, overrides, out_dir)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from gdn2.train.loop import NonFiniteLossError, fit

    try:
        result = fit(recipe, resume=resume)
    except NonFiniteLossError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except ValueError as e:  # configuration problems found while setting up (resume, world size, data)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if result is not None else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
