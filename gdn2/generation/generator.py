"""Batched generation: one packed prefill, then one token per step from an InferenceCache."""

from __future__ import annotations

import os.path
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch

from gdn2.generation.cuda_graph import CapturedDecodeStep
from gdn2.generation.sampling import SamplingParams, sample_tokens
from gdn2.generation.cache import InferenceCache
from gdn2.generation.decode import DecodeWeights, compiled_block_step, decode_step, prefill
from gdn2.model import GPT
from gdn2.tokenizer import Tokenizer

__all__ = ["Completion", "Generator", "generate"]


# Prompt tokens decoded in front of the completion so that its text is what follows the prompt's: enough
# to hold a leading word-boundary piece's context and a character split over byte-fallback pieces.
CONTEXT_TOKENS = 8


@dataclass
class Completion:
    """What one prompt produced: the new token ids (EOS excluded), their text (exactly what the ids add
    after the prompt's text, leading space included; cut before a stop string; None without a
    tokenizer) and why it ended: 'eos', 'stop' or 'length'."""

    tokens: list[int]
    text: Optional[str]
    finish_reason: str


class Generator:
    """Batched generation with a reusable cache (and, on CUDA, captured decode steps).

    ``max_batch_size`` rows are allocated once; a call with more prompts runs in slices. On CUDA a
    batch of n prompts runs in the smallest power-of-two bucket >= n (extra rows hold a one-token
    dummy prompt), each bucket with its own graph over a view of the shared cache. ``max_length``
    bounds prompt + generated tokens only where a layer attends to everything (full attention);
    sliding-window and GDN-2 layers keep a bounded state. ``vocab_limit`` masks logits of ids the
    tokenizer does not know (models whose embedding is padded past the tokenizer's vocabulary).

    ``fused`` (default True): decode on fused weight copies (:class:`gdn2.generation.decode.DecodeWeights`:
    the same logits, far fewer kernels per layer; about 0.55x the weight bytes more memory, freed by
    :meth:`release`), copied again at the start of every ``generate`` call, so that a Generator kept
    across optimizer steps or ``load_state_dict`` decodes the current weights.
    ``compile`` (default: True on CUDA, False elsewhere): run the decode step's pieces through
    ``torch.compile`` (:func:`gdn2.generation.decode.compiled_block_step`); the first call of each
    batch-size bucket compiles, once per process.
    """

    def __init__(self, model: GPT, tokenizer: Optional[Tokenizer] = None, max_batch_size: int = 8,
                 max_length: Optional[int] = None, cuda_graph: Optional[bool] = None,
                 vocab_limit: Optional[int] = None, compile: Optional[bool] = None, fused: bool = True) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_length = max_length or model.config.block_size
        self.device = model.lm_head.weight.device
        self.cuda_graph = (self.device.type == "cuda") if cuda_graph is None else cuda_graph
        if self.cuda_graph and self.device.type != "cuda":
            raise ValueError("cuda_graph=True needs the model on a CUDA device")
        if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens, the model only "
                             f"{model.config.vocab_size}")
        limit = vocab_limit if vocab_limit is not None else (tokenizer.vocab_size if tokenizer else None)
        self.vocab_limit = limit if limit is not None and limit < model.config.vocab_size else None
        self.compile = (self.device.type == "cuda") if compile is None else bool(compile)
        self.fused = bool(fused)
        # the compiled pieces are shared process-wide: each (layer kind, batch size) compiles once
        self._block_step = compiled_block_step() if self.compile else None
        self._weights: Optional[DecodeWeights] = None
        self._cache: Optional[InferenceCache] = None
        self._steps: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._pool = None

    # ---- resources --------------------------------------------------------------------------------
    def _bucket(self, n: int) -> int:
        if not self.cuda_graph:
            return n
        b = 1
        while b < n:
            b *= 2
        return min(b, self.max_batch_size)

    def _cache_rows(self, n: int) -> InferenceCache:
        if self._cache is None:
            dtype = self.model.lm_head.weight.dtype
            self._cache = InferenceCache(self.model, self.max_batch_size, device=self.device, dtype=dtype,
                                         max_length=self.max_length)
        return self._cache.rows(n)

    def refresh_weights(self) -> Optional[DecodeWeights]:
        """Make the fused weight copies match the parameters (built on first use; see
        :meth:`DecodeWeights.refresh`). Captured graphs are dropped if a copy had to be reallocated.
        Returns the weights (None when ``fused=False``)."""
        if not self.fused:
            return None
        if self._weights is None:
            self._weights = DecodeWeights(self.model)
        elif self._weights.refresh():
            # a dtype or device change: the captured graphs read the old tensors, the cache is stale too
            self._steps, self._cache = {}, None
        return self._weights

    def _step_fn(self, cache: InferenceCache) -> Callable[[torch.Tensor], torch.Tensor]:
        weights = self._weights if self.fused else None
        if not self.cuda_graph:
            return lambda tokens: decode_step(self.model, tokens, cache, weights, self._block_step)
        B = cache.batch_size
        if B not in self._steps:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            self._steps[B] = CapturedDecodeStep(self.model, cache, self._pool, self._block_step, weights)
        return self._steps[B]

    def release(self) -> None:
        """Free the cache, the captured graphs and the fused weight copies (e.g. before training
        resumes). The compiled code stays (it is shared by the process)."""
        self._cache, self._steps, self._pool, self._weights = None, {}, None, None

    # ---- generation -------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Union[str, Sequence[int]]],
                 params: Optional[SamplingParams] = None, **kwargs: Any) -> list[Completion]:
        """Continue each prompt (a str, encoded without BOS, or a list of token ids).

        ``params`` or keyword arguments of :class:`SamplingParams`. Returns one Completion per prompt,
        in order.
        """
        params = params or SamplingParams(**kwargs)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        encoded = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; pass token ids instead")
                p = self.tokenizer.encode(p)
            p = [int(t) for t in p]
            if not p:
                raise ValueError(f"prompt {i} is empty: give at least one token (e.g. EOS as a document start)")
            encoded.append(p)
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        self.refresh_weights()
        out: list[Completion] = []
        for s in range(0, len(encoded), self.max_batch_size):
            out += self._generate_batch(encoded[s: s + self.max_batch_size], params, generator)
        return out

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        generator: Optional[torch.Generator]) -> list[Completion]:
        n = len(prompts)
        longest = max(len(p) for p in prompts)
        B = self._bucket(n)
        cache = self._cache_rows(B)
        if cache.full_attention() and longest + params.max_new_tokens - 1 > self.max_length:
            raise ValueError(f"prompt of {longest} tokens + {params.max_new_tokens} new tokens exceeds "
                             f"max_length {self.max_length} of the full-attention cache")
        step = self._step_fn(cache)  # capture first: warming up scribbles on the cache
        cache.reset()
        dummy = [self.tokenizer.eos_id if self.tokenizer is not None and self.tokenizer.eos_id >= 0 else 0]
        rows = [torch.tensor(p, dtype=torch.long) for p in prompts + [dummy] * (B - n)]
        logits = prefill(self.model, rows, cache)

        eos = self.tokenizer.eos_id if self.tokenizer is not None else -1
        tokens: list[list[int]] = [[] for _ in range(n)]
        texts: list[Optional[str]] = [None] * n
        reasons: list[Optional[str]] = [None] * n
        on_cuda = self.device.type == "cuda"
        host = torch.empty(B, dtype=torch.long, pin_memory=on_cuda)
        copied = torch.cuda.Event() if on_cuda else None
        for t in range(params.max_new_tokens):
            if self.vocab_limit is not None:
                logits[:, self.vocab_limit:] = float("-inf")
            next_tokens = sample_tokens(logits, params, generator)
            host.copy_(next_tokens, non_blocking=on_cuda)
            if copied is not None:
                copied.record()
            if t + 1 < params.max_new_tokens:
                logits = step(next_tokens)  # queued: the GPU works on t+1 while the host checks t
            if copied is not None:
                copied.synchronize()
            for r, tok in enumerate(host[:n].tolist()):
                if reasons[r] is not None:
                    continue
                if params.stop_at_eos and tok == eos:
                    reasons[r] = "eos"
                    continue
                tokens[r].append(tok)
                if params.stop:
                    text = continuation_text(self.tokenizer, prompts[r], tokens[r])
                    cut = _first_stop(text, params.stop)
                    if cut is not None:
                        texts[r], reasons[r] = text[:cut], "stop"
            if all(reason is not None for reason in reasons):
                break
        if on_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        result = []
        for r in range(n):
            text = texts[r]
            if text is None and self.tokenizer is not None:
                text = continuation_text(self.tokenizer, prompts[r], tokens[r])
            result.append(Completion(tokens[r], text, reasons[r] or "length"))
        return result


def continuation_text(tokenizer: Any, prompt: Sequence[int], ids: Sequence[int]) -> str:
    """The text that token ids ``ids`` add after the text of ``prompt`` (both lists of int ids).

    Decoding ``ids`` alone is not that: SentencePiece drops the space of a leading word-boundary piece
    ("\u2581of" alone decodes to "of"), and a character whose bytes straddle the two is split. So the last
    few prompt tokens are decoded with ``ids`` and their own text is taken off the front; where the
    prompt's tail ends inside a character, the text starts with that whole character.
    """
    if not ids:
        return ""
    context = list(prompt[-CONTEXT_TOKENS:])
    head = tokenizer.decode(context)
    full = tokenizer.decode(context + list(ids))
    return full[len(os.path.commonprefix([head, full])):]


def _first_stop(text: str, stops: Sequence[str]) -> Optional[int]:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def generate(model: GPT, tokenizer: Optional[Tokenizer], prompts: Sequence[Union[str, Sequence[int]]],
             max_batch_size: int = 8, cuda_graph: Optional[bool] = None, compile: Optional[bool] = None,
             fused: bool = True, **kwargs: Any) -> list[Completion]:
    """One-shot helper: ``Generator(model, tokenizer, ...).generate(prompts, **sampling_kwargs)``."""
    return Generator(model, tokenizer, max_batch_size=max_batch_size, cuda_graph=cuda_graph, compile=compile,
                     fused=fused).generate(prompts, **kwargs)
