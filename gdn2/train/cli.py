"""``python -m gdn2 pretrain --config NAME [--section.key value ...]``: parse the named config and the
overrides (``gdn2.train.recipe``), then run the loop (``gdn2.train.loop.fit``). ``--help`` lists every
option."""

from __future__ import annotations

import os
import sys
from typing import Optional

USAGE = """usage: python -m gdn2 pretrain --config NAME|PATH.yaml [--section.key value ...]
                               [--resume auto|PATH] [--out_dir DIR] [--help] [--debug]

  --config NAME       a named config (gdn2/configs/NAME.yaml) or a YAML path; holds the model and the recipe
  --resume auto|PATH  auto: continue from the newest complete checkpoint of the run (start fresh if there
                      is none); PATH: a checkpoint folder (step-<N>) or a folder of checkpoints
  --out_dir DIR       run folder: config.yaml, metrics.jsonl, tensorboard/, checkpoints/ (default out/NAME)
  --section.key VALUE override one recipe value (also --section.key=VALUE); lists in YAML: [1, 2]
  --help              this text; with --config, the defaults shown are that config's values
  --debug             a traceback instead of one line for an expected error

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
    """Expected errors (bad options, config keys, data, resume) raise; ``gdn2.commandline.run`` turns
    them into one line. Exit 3: the run stopped on non-finite losses."""
    from gdn2.train.recipe import load_recipe, options_help

    argv = sys.argv[1:] if argv is None else argv
    config, overrides, resume, out_dir, want_help = parse_args(argv)
    if want_help:
        recipe = load_recipe(config, overrides, out_dir) if config else None
        print(USAGE + options_help(recipe))
        return 0
    if config is None:
        raise ValueError("--config is required (a named config or a YAML path)")
    recipe = load_recipe(config, overrides, out_dir)

    from gdn2.train.loop import NonFiniteLossError, fit

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        fit(recipe, resume=resume)
    except NonFiniteLossError as e:
        print(f"pretrain: error: {e}", file=sys.stderr)
        return 3
    return 0
