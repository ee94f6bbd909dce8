"""Command line: generate text from a checkpoint (``python -m gdn2 generate``).

    python -m gdn2 generate --checkpoint out/run/final/model.pt --prompt "Once upon a time" \\
        [--max_new_tokens 64] [--temperature 0.8 --top_k 50 --top_p 0.95 --seed 0] [--stop "\\n\\n"]
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from gdn2.checkpoint.load import load_model
from gdn2.generation.generator import Generator
from gdn2.generation.sampling import SamplingParams
from gdn2.tokenizer import TOKENIZER_FILE

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gdn2 generate", description="Generate text from a gdn2 checkpoint.")
    parser.add_argument("--checkpoint", required=True, help="consolidated .pt file or training checkpoint directory")
    parser.add_argument("--config", help="config name or YAML path (default: the one saved with the checkpoint)")
    parser.add_argument("--tokenizer", help=f"{TOKENIZER_FILE} path (default: found beside the checkpoint)")
    parser.add_argument("--prompt", action="append", required=True, help="repeatable: prompts run as one batch")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="repeatable stop string")
    parser.add_argument("--device")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no_cuda_graph", action="store_true")
    parser.add_argument("--compile", dest="compile", action="store_true", default=None,
                        help="torch.compile the decode step (default: on CUDA; the first call compiles, ~10 s)")
    parser.add_argument("--no_compile", dest="compile", action="store_false", help="do not compile the decode step")
    parser.add_argument("--no_fused", action="store_true",
                        help="decode on the parameters as they are, without the fused weight copies")
    args = parser.parse_args(argv)
    loaded = load_model(args.checkpoint, config=args.config, tokenizer=args.tokenizer, device=args.device,
                        dtype=args.dtype)
    gen = Generator(loaded.model, loaded.tokenizer, max_batch_size=len(args.prompt),
                    cuda_graph=False if args.no_cuda_graph else None, compile=args.compile,
                    fused=not args.no_fused)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, stop=tuple(s.encode().decode("unicode_escape") for s in args.stop),
                            seed=args.seed)
    for prompt, completion in zip(args.prompt, gen.generate(args.prompt, params)):
        print(f"{prompt}{completion.text}")
        print(f"[{len(completion.tokens)} tokens, {completion.finish_reason}]", file=sys.stderr)
    return 0
