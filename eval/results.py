"""lm-eval results as gdn2 reports them: flat ``task/metric`` numbers and the paper's average.

No lm-eval import: ``gdn2 compare`` and the trainer's logs read recorded results with this alone.
"""

from __future__ import annotations

import math

# The paper's Avg: mean of LAMBADA acc and eight reasoning accuracies. acc_norm where the
# paper's tables use it (HellaSwag, ARC-Challenge) and for OpenBookQA, whose answers differ in length
# (the usual choice in lm-eval-based reports); plain acc elsewhere.
REFERENCE_AVERAGE = {
    "lambada_openai": "acc", "piqa": "acc", "hellaswag": "acc_norm", "winogrande": "acc",
    "arc_easy": "acc", "arc_challenge": "acc_norm", "openbookqa": "acc_norm", "social_iqa": "acc",
    "boolq": "acc",
}


def summarize(results: dict) -> dict[str, float]:
    """Flatten lm-eval results into ``{"task/metric": value}`` (filter 'none' dropped, stderr left out),
    plus ``avg`` (the paper's average) when all its nine tasks are present."""
    flat: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or "_stderr" in key
                    or key.startswith("sample_len")):
                continue
            metric, _, filt = key.partition(",")
            name = metric if filt in ("", "none") else f"{metric},{filt}"
            flat[f"{task}/{name}"] = float(value)
    picked = [flat.get(f"{t}/{m}") for t, m in REFERENCE_AVERAGE.items()]
    if all(v is not None and not math.isnan(v) for v in picked):
        flat["avg"] = float(sum(picked) / len(picked))  # type: ignore[arg-type]
    return flat
