"""The paper's long-context retrieval (NIAH) and recall tables, from the summaries of ``gdn2 eval``.

A summary is ``{"task/metric": value}`` (:func:`gdn2.eval.results.summarize`); several of them, one per
model, make the rows. ``gdn2 eval`` adds these tables to its ``.md`` and ``gdn2 compare`` to
``compare.md`` whenever the results hold the tasks (``gdn2_niah``, ``gdn2_paper_recall``).

    niah_table({"gdn2_1.3B": summary, ...})  # | model | S-NIAH-1 1K | S-NIAH-1 2K | ... | MK-NIAH-1 8K |
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Sequence

# (column heading, task) in the paper's order
NIAH_TASKS = (("S-NIAH-1", "gdn2_niah_single_1"), ("S-NIAH-2", "gdn2_niah_single_2"),
              ("S-NIAH-3", "gdn2_niah_single_3"), ("MK-NIAH-1", "gdn2_niah_multikey_1"))
# (column heading, task/metric); lm-eval's 'contains' is a fraction, shown x 100
RECALL_TASKS = (("SWDE", "gdn2_recall_swde/contains"), ("SQuAD", "gdn2_recall_squad_completion/contains"),
                ("FDA", "gdn2_recall_fda/contains"))
NIAH_GROUP = "gdn2_niah"


def length_label(length: int) -> str:
    """1024 -> '1K', 1536 -> '1.5K', 131072 -> '128K', 192 -> '192'."""
    if length >= 1024 and length % 512 == 0:
        return f"{length / 1024:g}K"
    return str(length)


def niah_scores(summary: Mapping[str, Any]) -> dict[tuple[str, int], float]:
    """``{(task, length): score 0-100}`` of the NIAH tasks in a summary (metrics named by length)."""
    names = {task for _, task in NIAH_TASKS}
    found = {}
    for key, value in summary.items():
        task, _, metric = key.partition("/")
        if task in names and metric.isdigit() and isinstance(value, (int, float)) and not isinstance(value, bool):
            found[(task, int(metric))] = float(value)
    return found


def _cell(value: Optional[float], digits: int = 1) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    return f"{value:.{digits}f}"


def niah_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """The paper's NIAH table, ``rows``: model name -> summary. Columns: each task at each length any row
    has (0-100, mean of its samples); empty string when no row has NIAH results."""
    scores = {name: niah_scores(summary) for name, summary in rows.items()}
    lengths = sorted({length for found in scores.values() for _, length in found})
    tasks = [(head, task) for head, task in NIAH_TASKS if any(t == task for found in scores.values() for t, _ in found)]
    if not lengths:
        return ""
    heads = [f"{head} {length_label(length)}" for head, _ in tasks for length in lengths]
    lines = ["| model | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for name, found in scores.items():
        if found:
            cells = [_cell(found.get((task, length))) for _, task in tasks for length in lengths]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def recall_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """The paper's recall table (SWDE, SQuAD, FDA accuracy x 100 and their mean); empty string when no
    row has any of them."""
    present = {name: {head: summary.get(key) for head, key in RECALL_TASKS} for name, summary in rows.items()}
    present = {name: cells for name, cells in present.items()
               if any(isinstance(v, (int, float)) for v in cells.values())}
    if not present:
        return ""
    lines = ["| model | " + " | ".join(head for head, _ in RECALL_TASKS) + " | Avg |",
             "|---|" + "---|" * (len(RECALL_TASKS) + 1)]
    for name, cells in present.items():
        values = [100.0 * float(v) if isinstance(v, (int, float)) else None for v in cells.values()]
        average = sum(values) / len(values) if all(v is not None for v in values) else None  # type: ignore[misc]
        lines.append(f"| {name} | " + " | ".join(_cell(v) for v in values) + f" | {_cell(average)} |")
    return "\n".join(lines) + "\n"


def paper_tables(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """The NIAH and recall tables that ``rows`` have results for, each under a heading (Markdown);
    empty string when none."""
    parts = []
    niah = niah_table(rows)
    if niah:
        parts.append("## Long-context retrieval (RULER needle in a haystack, score 0-100)\n\n" + niah)
    recall = recall_table(rows)
    if recall:
        parts.append("## Recall-intensive tasks (accuracy %, prompts cut to 2048 tokens around the answer)\n\n"
                     + recall)
    return "\n".join(parts)


def asks_for_niah(tasks: Sequence[str]) -> bool:
    """Whether lm-eval task names include the NIAH group or one of its tasks."""
    return any(t == NIAH_GROUP or t in {task for _, task in NIAH_TASKS} for t in tasks)


def niah_metadata(max_seq_lengths: Optional[str], metadata: Optional[str]) -> dict[str, Any]:
    """The task metadata of ``gdn2 eval``'s ``--metadata`` (a JSON object) and ``--max_seq_lengths``
    (comma-separated lengths, which wins); a ValueError names the flag."""
    import json

    found: dict[str, Any] = {}
    if metadata:
        try:
            found = json.loads(metadata)
        except json.JSONDecodeError as error:
            raise ValueError(f"--metadata is not JSON: {error}") from None
        if not isinstance(found, dict):
            raise ValueError(f"--metadata must be a JSON object, got {metadata!r}")
    if max_seq_lengths is not None:
        from gdn2.eval.tasks.gdn2_niah.niah import parse_lengths

        try:
            found["max_seq_lengths"] = list(parse_lengths(max_seq_lengths))
        except ValueError as error:
            raise ValueError(str(error).replace("gdn2_niah: metadata max_seq_lengths", "--max_seq_lengths")) from None
    return found


def niah_window(tasks: Sequence[str], metadata: Mapping[str, Any]) -> Optional[int]:
    """The model window NIAH needs so that no prompt is cut: its longest length plus one (gdn2 puts EOS
    before each prompt); None when no NIAH task is asked for."""
    if not asks_for_niah(tasks):
        return None
    from gdn2.eval.tasks.gdn2_niah.niah import settings_from

    return max(settings_from(metadata).lengths) + 1
