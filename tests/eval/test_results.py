"""gdn2/eval/results.py: flat summaries and the paper's average."""

import pytest

from gdn2.eval.results import summarize


def test_summary_average_follows_reference():
    metrics = {"lambada_openai": {"acc,none": 0.5, "perplexity,none": 10.0},
               "piqa": {"acc,none": 0.7, "acc_norm,none": 0.1}, "hellaswag": {"acc,none": 0.1, "acc_norm,none": 0.4},
               "winogrande": {"acc,none": 0.55}, "arc_easy": {"acc,none": 0.6, "acc_norm,none": 0.1},
               "arc_challenge": {"acc,none": 0.1, "acc_norm,none": 0.3},
               "openbookqa": {"acc,none": 0.1, "acc_norm,none": 0.35}, "social_iqa": {"acc,none": 0.4},
               "boolq": {"acc,none": 0.6, "acc_stderr,none": 0.01}}
    summary = summarize({"results": metrics})
    assert summary["avg"] == pytest.approx((0.5 + 0.7 + 0.4 + 0.55 + 0.6 + 0.3 + 0.35 + 0.4 + 0.6) / 9)
    assert "boolq/acc_stderr" not in summary
    del metrics["boolq"]
    assert "avg" not in summarize({"results": metrics})
