"""Text generation: one packed prefill, then one token per step from an InferenceCache.

Prompts of different lengths are packed into one row and prefilled as separate documents
(:func:`gdn2.generation.decode.prefill`), so each sees exactly what it would alone and nothing is padded; the
GDN-2 states and conv tails go to the prompt's cache row, and attention keys go to columns that
right-align the prompts. Decoding then writes one shared column per step; a row whose prompt was
shorter masks the columns before its start, and RoPE uses each row's own positions.

On CUDA the decode step is captured once per batch-size bucket in a CUDA graph (every cache update is
in place, the column counter lives on the device), so a token costs one graph launch plus sampling.
While the host inspects token t for EOS and stop strings, the GPU already computes token t+1. The
step runs on fused weight copies (:class:`gdn2.generation.decode.DecodeWeights`: one GEMM for the seven input
projections of a GDN-2 layer, one for the MLP's w1 | w2), copied again at the start of every
``generate`` call, and on CUDA its pieces are compiled with ``torch.compile`` (once per process and
batch-size bucket, shared by all Generators). ``compile=False`` / ``--no_compile`` skip the compiler;
``fused=False`` / ``--no_fused`` run the parameters as they are (no extra memory for the copies).

- :mod:`~gdn2.generation.cache`: InferenceCache (every layer's cache, the columns reached);
- :mod:`~gdn2.generation.decode`: prefill, extend, decode_step, DecodeWeights, the compiled step pieces;
- :mod:`~gdn2.generation.sampling`: SamplingParams, filter_logits, sample_tokens;
- :mod:`~gdn2.generation.cuda_graph`: CapturedDecodeStep;
- :mod:`~gdn2.generation.generator`: Generator, Completion, generate;
- :mod:`~gdn2.generation.cli`: ``python -m gdn2 generate``.
"""

from gdn2.generation.cache import InferenceCache
from gdn2.generation.cuda_graph import CapturedDecodeStep
from gdn2.generation.decode import DecodeWeights, decode_step, extend, prefill
from gdn2.generation.generator import Completion, Generator, generate
from gdn2.generation.sampling import SamplingParams, filter_logits, sample_tokens

__all__ = ["SamplingParams", "filter_logits", "sample_tokens", "CapturedDecodeStep", "Completion", "Generator",
           "generate", "InferenceCache", "DecodeWeights", "prefill", "extend", "decode_step"]
