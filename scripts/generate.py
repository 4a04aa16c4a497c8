"""Generate with titanrl's paged generator from an HF safetensors folder.

    python scripts/generate.py --hf_checkpoint DIR --prompt "12+34=" --max_new_tokens 16 [--n 4]

The tokenizer is the folder's tokenizer.json when present, else the built-in byte tokenizer
(or --tokenizer byte|DIR). Prints one JSON object per completion, then one with statistics.
"""

import argparse
import dataclasses
import json
import os

import torch

from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.models.hf import read_hf_config
from titanrl.models.tokenizer import build_tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf_checkpoint", required=True, help="folder with config.json and safetensors")
    parser.add_argument("--tokenizer", default="", help="'byte' or a folder with tokenizer.json")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--top_k", type=int, default=0)
    parser.add_argument("--min_p", type=float, default=0.0)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--num_blocks", type=int, default=0, help="KV blocks; 0 = from free memory")
    parser.add_argument("--block_size", type=int, default=16)
    args = parser.parse_args(argv)

    tokenizer_spec = args.tokenizer or (
        args.hf_checkpoint if os.path.exists(os.path.join(args.hf_checkpoint, "tokenizer.json")) else "byte"
    )
    tokenizer = build_tokenizer(tokenizer_spec)
    model_args = read_hf_config(args.hf_checkpoint)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = GeneratorConfig(block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory_fraction=0.2)
    gen = Generator(model_args, config, device, tokenizer=tokenizer)
    gen.load_hf(args.hf_checkpoint)

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        n=args.n,
        seed=args.seed,
        stop_strings=args.stop,
    )
    completions, stats = gen.generate([tokenizer.encode(p) for p in args.prompt], params)
    for c in completions:
        print(json.dumps({"prompt": args.prompt[c.prompt_index], **dataclasses.asdict(c)}))
    print(json.dumps({"stats": {**dataclasses.asdict(stats), "tokens_per_s": stats.tokens_per_s}}))


if __name__ == "__main__":
    main()
