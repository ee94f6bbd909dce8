"""``python -m gdn2 pretrain --config NAME [--section.key value ...]``: parse the named config and the
overrides (``gdn2.train.recipe``), then run the loop (``gdn2.train.loop.fit``). ``--help`` lists every
option."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

from gdn2.commandline import command_help, option, parse_options, underscore_flags

DESCRIPTION = """Train a model. Besides the options below, --section.key VALUE (or --section.key=VALUE)
overrides one recipe value (lists in YAML: [1, 2]); the recipe's sections and keys follow, with that
config's values when --config is given."""


@dataclass(kw_only=True)
class PretrainOptions:
    config: str = option(help="a named config (configs/NAME.yaml) or a YAML path; holds the model and the recipe")
    resume: Optional[str] = option(None, "auto: continue from the newest complete checkpoint of the run (start "
                                         "fresh if there is none); PATH: a checkpoint folder (step-<N>) or a "
                                         "folder of checkpoints", meaning_of_null="start fresh")
    out_dir: Optional[str] = option(None, "run folder: config.yaml, metrics.jsonl, tensorboard/, checkpoints/",
                                    meaning_of_null="out/<config>")


def split_overrides(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the command's own flags, ``{"section.key": text}``) from the command line; ValueError for a
    recipe key given twice or without a value."""
    rest: list[str] = []
    overrides: dict[str, str] = {}
    argv = underscore_flags(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        key, eq, value = arg[2:].partition("=")
        if not (arg.startswith("--") and "." in key):
            rest.append(arg)
            continue
        if not eq:
            if i >= len(argv):
                raise ValueError(f"--{key} needs a value")
            value, i = argv[i], i + 1
        if key in overrides:
            raise ValueError(f"--{key} given twice")
        overrides[key] = value
    return rest, overrides


def main(argv: Optional[list[str]] = None) -> int:
    """Expected errors (bad options, config keys, data, resume) raise; ``gdn2.commandline.run`` turns
    them into one line. Exit 3: the run stopped on non-finite losses."""
    from gdn2.train.recipe import load_recipe, options_help

    argv = sys.argv[1:] if argv is None else argv
    rest, overrides = split_overrides(argv)
    if "-h" in rest or "--help" in rest:
        # with --config, the defaults shown are that config's values
        named = [a for a in rest if a not in ("-h", "--help")]
        shown = parse_options(PretrainOptions, named, "gdn2 pretrain") if "--config" in " ".join(named) else None
        recipe = load_recipe(shown.config, overrides, shown.out_dir) if shown is not None else None
        print(command_help(PretrainOptions, "gdn2 pretrain", DESCRIPTION) + "\n" + options_help(recipe))
        return 0
    args = parse_options(PretrainOptions, rest, "gdn2 pretrain", DESCRIPTION)
    recipe = load_recipe(args.config, overrides, args.out_dir)

    from gdn2.train.loop import NonFiniteLossError, fit

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        fit(recipe, resume=args.resume)
    except NonFiniteLossError as e:
        print(f"pretrain: error: {e}", file=sys.stderr)
        return 3
    return 0
