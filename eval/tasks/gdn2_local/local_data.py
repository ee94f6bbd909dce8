"""Loads the task data that ships beside these YAML files, so the local tasks run offline.

``dataset_path: json`` with ``data_files`` would resolve the files against the working directory;
``custom_dataset`` resolves them against this folder instead, wherever lm-eval is started from.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets

DATA = Path(__file__).resolve().parent / "data"


def _load(name: str) -> datasets.DatasetDict:
    path = DATA / name
    if not path.is_file():
        raise FileNotFoundError(f"local task data {path} does not exist")
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


# lm-eval passes the task metadata (and model arguments) as keywords; the data does not depend on them.
def multiple_choice(**_kwargs) -> datasets.DatasetDict:
    return _load("mc.jsonl")


def paragraphs(**_kwargs) -> datasets.DatasetDict:
    return _load("ppl.jsonl")


def last_word(**_kwargs) -> datasets.DatasetDict:
    return _load("lambada.jsonl")


def completions(**_kwargs) -> datasets.DatasetDict:
    return _load("gen.jsonl")
