"""Multi-turn episodes against local environment servers vs the in-process pool, in one run.

    python -m benchmarks.bench_env_servers --out benchmarks/bench_env_servers.json

One rank, the paged generator (debug shape, random weights, no eos stop), `prompts * group_size`
episodes in flight at once (256 by default), each `turns` model turns of `turn_tokens` tokens with
an observation between them, the same episodes in both:
  in_process  EnvPool: the environment in `--workers` worker processes (titanrl/envs/pool.py)
  servers     ServerEnvPool: the same environment behind `--servers` local `titanrl serve-env`
              servers (OpenEnv's WebSocket sessions, titanrl/envs/server_pool.py)
Reports episodes/s and the generator's idle time (seconds its scheduler blocked in the turn
handler's poll, waiting for environments), median of --repeats alternating runs, and ratios.
"""

import argparse
import statistics
import time

import torch

from benchmarks.harness import episode_report, timed_call
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.envs.base import Environment
from titanrl.envs.multi_turn import MultiTurnRollout
from titanrl.envs.pool import EnvPool
from titanrl.envs.pool_builder import LocalServers
from titanrl.envs.server_pool import ServerEnvPool
from titanrl.generator import Generator, SamplingParams
from titanrl.models.flavors import get_model_args
from titanrl.models.tokenizer import ByteTokenizer

SPEC = "benchmarks.bench_env_servers:FixedTurnsEnv"
DOC_TABLES = [("Episodes/s and generator idle seconds (median)", ["summary"], None), ("Ratios", ["ratios"], None)]


class FixedTurnsEnv(Environment):
    """Answers every turn with a short observation; done after `turns` turns (default 3)."""

    def __init__(self, turns: int = 3) -> None:
        self.turns, self.seen = turns, 0

    def reset(self, sample):
        return sample["prompt"]

    def step(self, model_text):
        self.seen += 1
        return (
            ("", 1.0, True, {"correct": True}) if self.seen >= self.turns else ("<result>42</result>", 0.0, False, {})
        )


class TimedTurns(MultiTurnRollout):
    """MultiTurnRollout that adds up the time the generator spends blocked waiting on environments."""

    idle_s = 0.0

    def poll(self, block: bool):
        start = time.perf_counter()
        out = super().poll(block)
        if block:
            self.idle_s += time.perf_counter() - start
        return out


def run_episodes(gen, pool, tok, texts, a) -> dict:
    turns = TimedTurns(pool, tok, a.turns, 10_000)
    prompts = turns.start(
        [{"prompt": t, "answer": ""} for t in texts], a.group_size, lambda t: [tok.bos_id, *tok.encode(t)]
    )
    gen.allocator.reset_prefix_cache()
    params = SamplingParams(max_new_tokens=a.turn_tokens, n=a.group_size, seed=0)
    seconds, _ = timed_call(lambda: gen.generate(prompts, params, turns=turns))
    episodes = list(turns.episodes.values())
    assert all(e.failed is None and e.turns == a.turns for e in episodes), [e.failed for e in episodes][:4]
    return {"seconds": seconds, "episodes_per_s": len(episodes) / seconds, "generator_idle_s": turns.idle_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="")
    a = p.parse_args()
    tok = ByteTokenizer()
    gen = Generator(get_model_args("debug"), GeneratorConfig(block_size=16, num_blocks=4096), torch.device("cpu"))
    gen.wake()
    texts = [f"episode {i:04d}: " for i in range(a.prompts)]
    local = LocalServers(SPEC, {}, a.servers, None, 120.0)
    pools = {
        "in_process": EnvPool(SPEC, {"turns": a.turns}, num_workers=a.workers),
        "servers": ServerEnvPool(local.urls, timeout_s=60.0, on_close=local.stop),
    }
    runs: dict[str, list[dict]] = {name: [] for name in pools}
    try:
        for pool in pools.values():
            run_episodes(gen, pool, tok, texts, a)  # warm-up
        for _ in range(a.repeats):
            for name, pool in pools.items():
                runs[name].append(run_episodes(gen, pool, tok, texts, a))
    finally:
        for pool in pools.values():
            pool.close()
    summary = {
        k: {
            "median_episodes_per_s": statistics.median(r["episodes_per_s"] for r in v),
            "median_generator_idle_s": statistics.median(r["generator_idle_s"] for r in v),
            "median_seconds": statistics.median(r["seconds"] for r in v),
        }
        for k, v in runs.items()
    }
    ratios = {
        "servers_over_in_process_episodes_per_s": summary["servers"]["median_episodes_per_s"]
        / summary["in_process"]["median_episodes_per_s"],
        "servers_minus_in_process_idle_s": summary["servers"]["median_generator_idle_s"]
        - summary["in_process"]["median_generator_idle_s"],
    }
    episode_report(
        a.out,
        "multi-turn episodes: local OpenEnv-protocol servers vs in-process env workers (one rank, CPU)",
        vars(a) | {"concurrent_episodes": a.prompts * a.group_size, "model": "debug flavor, random weights"},
        summary,
        ratios,
        runs,
    )


if __name__ == "__main__":
    main()
