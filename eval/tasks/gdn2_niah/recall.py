"""The paper's recall-intensive tasks: lm-eval's SWDE, FDA and SQuAD completion (the Based versions,
from the Hugging Face hub), each prompt cut to ``recall_tokens`` (2048) tokens around its answer, as
Just-Read-Twice evaluates them.

lm-eval's own ``swde``, ``fda`` and ``squad_completion`` hand the whole document to the model, which
keeps its last ``max_length - 48`` tokens: a long document loses its start, and the answer with it
when it sits there. Here the document is cut before the model sees it: the prompt's question (its
``key:`` ending, else its last line) is kept whole, and of the document before it the
``recall_tokens - 48 - question`` tokens (48: the tokens the tasks generate) centred on the first
mention of the answer, or of the attribute's key when that comes first (SWDE, FDA), as
Just-Read-Twice centres its window. A prompt already within the budget is left as it is. The tokens
are those of the scored model's tokenizer (see :func:`niah.resolve_tokenizer`); ``recall_tokens`` is
a metadata key like the NIAH settings.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from gdn2.eval.tasks.gdn2_niah.niah import PromptTokenizer, _positive_int, resolve_tokenizer

DEFAULT_RECALL_TOKENS = 2048
GENERATED = 48  # max_gen_toks of lm-eval's swde, fda and squad_completion


def split_question(prompt: str, key: Optional[str], tokenizer: PromptTokenizer, budget: int) -> tuple[str, str]:
    """(document, question): the question is the ``{key}:`` the prompt ends with (SWDE, FDA), else its
    last line when that is short (at most a quarter of ``budget`` tokens), else nothing."""
    stripped = prompt.rstrip()
    if key and stripped.lower().endswith(key.strip().lower() + ":"):
        body = stripped[: len(stripped) - len(key.strip()) - 1].rstrip()
        return body, prompt[len(body):]
    if "\n" in stripped:
        body, last = prompt.rsplit("\n", 1)
        if tokenizer.count(last) <= budget // 4:
            return body, "\n" + last
    return prompt, ""


def first_mention(text: str, needles: Sequence[str]) -> Optional[int]:
    """Character index of the earliest case-insensitive occurrence of any of ``needles`` (None if none)."""
    found = [m.start() for n in needles if n and n.strip()
             for m in [re.search(re.escape(n.strip()), text, re.IGNORECASE)] if m]
    return min(found) if found else None


def cut_around_answer(prompt: str, answer: str, key: Optional[str], tokenizer: PromptTokenizer,
                      budget: int) -> str:
    """``prompt`` in at most about ``budget`` tokens: the question whole, and the window of the document
    centred on the first mention of ``answer`` (or ``key``). Unchanged when it already fits."""
    if tokenizer.count(prompt) <= budget:
        return prompt
    body, question = split_question(prompt, key, tokenizer, budget)
    room = max(1, budget - tokenizer.count(question))
    ids = list(tokenizer.encode(body))
    at = first_mention(body, [answer] + ([key] if key else []))
    # where the answer is not in the document, keep its end, as a left truncation would
    centre = len(ids) if at is None else tokenizer.count(body[:at])
    start = max(0, centre - room // 2)
    end = min(len(ids), start + room)
    start = max(0, end - room)
    return tokenizer.decode(ids[start:end]) + question


def _truncating(base: type, name: str) -> type:
    """``base`` (an lm-eval task class) whose prompts go through :func:`cut_around_answer`."""

    class RecallTask(base):
        def __init__(self, config: Optional[dict] = None, **kwargs: Any) -> None:
            # set before lm-eval's constructor, which already renders a prompt
            metadata = dict((config or {}).get("metadata") or {})
            self._recall_metadata = metadata
            self._recall_budget = _positive_int(metadata.get("recall_tokens", DEFAULT_RECALL_TOKENS),
                                                "recall_tokens", minimum=GENERATED + 1) - GENERATED
            self._recall_tokenizer: Optional[PromptTokenizer] = None
            self._recall_cut: dict[tuple[str, str, str], str] = {}
            base.__init__(self)
            self.config.metadata = {**(self.config.metadata or {}), "recall_tokens": self._recall_budget + GENERATED}

        def doc_to_text(self, doc: dict, doc_to_text: Any = None) -> str:
            prompt = base.doc_to_text(self, doc)
            answer = str(doc.get("value", "")).strip()
            key = doc.get("key") if isinstance(doc.get("key"), str) else None
            memo = (prompt, answer, key or "")
            if memo not in self._recall_cut:
                if self._recall_tokenizer is None:
                    self._recall_tokenizer = resolve_tokenizer(self._recall_metadata, task=self.config.task or name)
                self._recall_cut[memo] = cut_around_answer(prompt, answer, key, self._recall_tokenizer,
                                                           self._recall_budget)
            return self._recall_cut[memo]

    RecallTask.__name__ = RecallTask.__qualname__ = f"Recall{base.__name__}"
    return RecallTask


def __getattr__(name: str):
    # lm-eval's task modules (and the data sets behind them) only when a task is built
    if name == "SWDE":
        from lm_eval.tasks.swde.task import SWDE

        return _truncating(SWDE, "gdn2_recall_swde")
    if name == "FDA":
        from lm_eval.tasks.fda.task import FDA

        return _truncating(FDA, "gdn2_recall_fda")
    if name == "SQuADCompletion":
        from lm_eval.tasks.squad_completion.task import SQUADCompletion

        return _truncating(SQUADCompletion, "gdn2_recall_squad_completion")
    raise AttributeError(name)
