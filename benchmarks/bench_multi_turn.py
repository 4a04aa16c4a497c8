"""Multi-turn vs single-turn rollout throughput on the paged generator, in one run.

    python -m benchmarks.bench_multi_turn --out benchmarks/bench_multi_turn.json

Same model (debug shape, random weights), same prompts, same number of model tokens per sample:
  single_turn      one generate call, `turns * turn_tokens` new tokens per sample
  multi_turn       `turns` turns of `turn_tokens` with an environment observation between them,
                   env steps in worker processes overlapped with decoding, KV blocks kept
  multi_turn_naive the same episodes as a loop of generate calls, each re-prefilling the whole
                   conversation (what a stateless inference server does)
Reports model tokens/s, prefill tokens and their ratios; median of --repeats alternating runs.
"""

import argparse
import json
import statistics

import torch

from benchmarks.harness import timed_call, write_json
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.envs.base import Environment
from titanrl.envs.multi_turn import MultiTurnRollout
from titanrl.envs.pool import EnvPool
from titanrl.generator import Generator, SamplingParams
from titanrl.models.flavors import get_model_args
from titanrl.models.tokenizer import ByteTokenizer

OBSERVATION = "<result>observation 42</result>"
DOC_TABLES = [
    ("Model tokens/s (median) and prefill tokens", ["summary"], None),
    ("Ratios", ["ratios"], None),
]


class FixedTurnsEnv(Environment):
    """Answers every turn with OBSERVATION; done after `turns` turns."""

    def __init__(self, turns: int = 3) -> None:
        self.turns, self.seen = turns, 0

    def reset(self, sample):
        return sample["prompt"]

    def step(self, model_text):
        self.seen += 1
        return ("", 1.0, True, {}) if self.seen >= self.turns else (OBSERVATION, 0.0, False, {})


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="")
    return p.parse_args()


def make_report(a: argparse.Namespace, runs: dict[str, list[dict]], observation_tokens: int, model_tokens: int) -> dict:
    """Medians of the runs and the multi-turn rollout's speed against single-turn and naive."""
    summary = {
        k: {
            "median_model_tokens_per_s": statistics.median(r["model_tokens_per_s"] for r in v),
            "prefill_tokens": v[0]["prefill_tokens"],
        }
        for k, v in runs.items()
    }
    ratios = {
        "multi_turn_over_single_turn": summary["multi_turn"]["median_model_tokens_per_s"]
        / summary["single_turn"]["median_model_tokens_per_s"],
        "multi_turn_over_naive": summary["multi_turn"]["median_model_tokens_per_s"]
        / summary["multi_turn_naive"]["median_model_tokens_per_s"],
    }
    return {
        "benchmark": "multi-turn vs single-turn rollout throughput (paged generator, CPU)",
        "config": vars(a)
        | {
            "model": "debug flavor, random weights",
            "observation_tokens": observation_tokens,
            "model_tokens_per_run": model_tokens,
        },
        "summary": summary,
        "ratios": ratios,
        "runs": runs,
    }


def main() -> None:
    a = parse_args()
    tok = ByteTokenizer()
    args = get_model_args("debug")
    gen = Generator(args, GeneratorConfig(block_size=16, num_blocks=1024), torch.device("cpu"))  # no eos stop
    gen.wake()
    g = torch.Generator().manual_seed(0)
    texts = [
        "".join(chr(97 + int(i)) for i in torch.randint(0, 26, (a.prompt_len,), generator=g)) for _ in range(a.prompts)
    ]
    prompts = [[tok.bos_id, *tok.encode(t)] for t in texts]
    obs = tok.encode(OBSERVATION)
    model_tokens = a.prompts * a.group_size * a.turns * a.turn_tokens
    # The env workers import FixedTurnsEnv from this module.
    pool = EnvPool("benchmarks.bench_multi_turn:FixedTurnsEnv", {"turns": a.turns}, num_workers=2)

    def single():
        _, stats = gen.generate(prompts, SamplingParams(max_new_tokens=a.turns * a.turn_tokens, n=a.group_size, seed=0))
        return stats.prefill_tokens

    def multi():
        turns = MultiTurnRollout(pool, tok, a.turns, 10_000)
        ps = turns.start(
            [{"prompt": t, "answer": ""} for t in texts], a.group_size, lambda t: [tok.bos_id, *tok.encode(t)]
        )
        _, stats = gen.generate(ps, SamplingParams(max_new_tokens=a.turn_tokens, n=a.group_size, seed=0), turns=turns)
        return stats.prefill_tokens

    def naive():
        convs = [list(p) for p in prompts for _ in range(a.group_size)]
        prefill = 0
        for turn in range(a.turns):
            completions, stats = gen.generate(convs, SamplingParams(max_new_tokens=a.turn_tokens, seed=turn))
            prefill += stats.prefill_tokens
            convs = [c + comp.token_ids + (obs if turn + 1 < a.turns else []) for c, comp in zip(convs, completions)]
        return prefill

    runs: dict[str, list[dict]] = {"single_turn": [], "multi_turn": [], "multi_turn_naive": []}
    fns = {"single_turn": single, "multi_turn": multi, "multi_turn_naive": naive}
    try:
        for fn in fns.values():
            fn()  # warm-up
        for _ in range(a.repeats):
            for name, fn in fns.items():
                # As after a weight sync in RL: no K/V cached from an earlier run.
                gen.allocator.reset_prefix_cache()
                seconds, prefill = timed_call(fn)
                runs[name].append(
                    {"seconds": seconds, "prefill_tokens": prefill, "model_tokens_per_s": model_tokens / seconds}
                )
    finally:
        pool.close()
    report = make_report(a, runs, len(obs), model_tokens)
    summary, ratios = report["summary"], report["ratios"]
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=2))
    if a.out:
        write_json(a.out, report)


if __name__ == "__main__":
    main()
