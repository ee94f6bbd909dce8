"""Evaluation: lm-eval on gdn2 checkpoints, and comparison of training runs.

- ``lm``: the lm-eval model ``gdn2`` (a GPT from a checkpoint or in process); importing it registers the name
- ``harness``: a task manager that knows gdn2's offline tasks (``tasks/``), ``evaluate_model`` on a live model
- ``results``: flat ``task/metric`` summaries and the paper's average (no lm-eval import)
- ``run``: ``python -m gdn2 eval``; ``compare``: ``python -m gdn2 compare`` (no lm-eval needed)
- ``tasks/``: task YAMLs and their data (package data)

Installed as ``gdn2.eval``; importing this package imports nothing of lm-eval and patches nothing.
"""

from pathlib import Path

# gdn2's own task definitions (package data: eval/tasks, offline): an ``include_path`` for lm-eval, also
# on its own command line (``python -m gdn2 eval --print_include_path`` prints it).
LOCAL_TASKS = Path(__file__).resolve().parent / "tasks"
