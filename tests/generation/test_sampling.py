"""gdn2/generation/sampling.py: top-k / nucleus filtering, draws, argument checks."""

import pytest
import torch

from gdn2.generation import SamplingParams, filter_logits, sample_tokens


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda t: torch.isfinite(t)[0].tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_p=0.5)) == [True, False, False, False]
    assert kept(filter_logits(logits, top_p=0.8)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_p=0.81)) == [True, True, True, False]
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_tokens(logits, SamplingParams(temperature=1.0, top_k=2), g)) for _ in range(50)}
    assert draws == {0, 1}
    assert int(sample_tokens(logits, SamplingParams())) == 0  # temperature 0: greedy


def test_bad_sampling_parameters_are_value_errors():
    for kw, name in ((dict(max_new_tokens=0), "max_new_tokens"), (dict(top_p=0.0), "top_p"),
                     (dict(temperature=-1.0), "temperature"), (dict(top_k=-1), "top_k")):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kw)
    assert SamplingParams(stop="\n").stop == ("\n",)
