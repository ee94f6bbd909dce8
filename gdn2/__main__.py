"""The gdn2 command line: ``python -m gdn2 <command> [options]`` (or the ``gdn2`` script).

Every command takes ``--help``. Flags are spelled with underscores (``--max_new_tokens``), like the
recipe's ``--section.key`` overrides; the dashed spelling (``--max-new-tokens``) is accepted too.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

# command -> (module, function, one line of help). Modules are imported only when their command runs:
# the data-preparation workers re-import this file and must stay light.
COMMANDS = {
    "pretrain": ("gdn2.train.cli", "main", "train a model from a named config or YAML recipe"),
    "generate": ("gdn2.generation.cli", "main", "generate text from a checkpoint"),
    "eval": ("gdn2.eval.run", "main", "score a checkpoint with lm-eval tasks"),
    "compare": ("gdn2.eval.compare", "main", "compare run folders: table and picture"),
    "study": ("gdn2.study", "main", "the quality study: a learning-rate sweep per config, seeds, NIAH, compare"),
    "tokenizer": ("gdn2.data_prep.train_tokenizer", "main", "train a SentencePiece tokenizer"),
    "prepare": ("gdn2.data_prep.prepare", "main", "tokenise a corpus into packed shards"),
    "corpus": ("gdn2.data_prep.default_corpus", "main", "build the built-in corpus (no download)"),
    "consolidate": ("gdn2.checkpoint.consolidate", "main", "turn a training checkpoint into one model.pt"),
    "mqar": ("gdn2.mqar", "main", "multi-query associative recall: GDN-2, its baselines and attention, a learning-rate sweep"),
    "hf": ("gdn2.hf.convert", "main", "export a checkpoint as a Hugging Face model folder, or import one"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m gdn2 <command> [options]   (python -m gdn2 <command> --help for its options)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, _, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"gdn2: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if command == "pretrain":
        from gdn2.train.slurm import catch_early_signals

        catch_early_signals()  # before torch is imported: a SLURM signal during start-up is answered
    from gdn2.commandline import run

    module, function, _ = COMMANDS[command]
    return run(getattr(importlib.import_module(module), function), rest, prog=f"gdn2 {command}")


def run_script(command: str) -> None:
    """The entry of a module that also runs as a script in a checkout (``python data_prep/prepare.py
    ...``): the same as ``python -m gdn2 <command> ...``."""
    sys.exit(main([command, *sys.argv[1:]]))


if __name__ == "__main__":
    sys.exit(main())
