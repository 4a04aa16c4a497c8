"""Two RL steps of a real job (the Trainer and the RL recipe on the debug model, GRPO on the
reverse task) with `[parallelism] cp` = the world size; rank 0 saves what each step generated,
its logged statistics and the parameters after the steps; every rank, how much its own
generator decoded (`<out>.<rank>`).

Launched by tests/test_context_parallel.py with torchrun: 1 rank (cp = 1, the reference) and
2 ranks (cp = 2, each rank generating half of the prompt groups). Cases: 3 prompts (an uneven
split) with streaming rewards; 1 prompt with DAPO's dynamic sampling (rank 1 has no prompt in
any round, and the rounds run in step); ReMax's greedy baseline rollouts, split alike.
"""

import argparse
import os

import torch
import torch.distributed as dist
from cp_worker import full_params

from titanrl.components import launch
from titanrl.components.launch import parse_args
from titanrl.train import build_trainer

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "train_configs", "grpo_reverse_debug.toml")
COMMON = [
    f"--job.config_file={CONFIG}",
    "--training.steps=2",
    "--sft_warmup.steps=0",
    "--algorithm.group_size=4",
    "--generator.max_new_tokens=6",
    "--generator.num_blocks=256",
    "--reward.num_workers=1",
    "--data.num_eval_samples=4",
    "--metrics.eval_freq=0",
    "--checkpoint.enable=false",
    "--optimizer.lr=1e-4",
    "--reward.function=cp_rollout_worker:parity_reward",
]
CASES = {
    "uneven": ["--training.batch_size=3"],
    "dapo_one_prompt": [
        "--training.batch_size=1",
        "--algorithm.group_size=2",
        "--rollout.dynamic_sampling=true",
        "--rollout.max_sampling_rounds=3",
    ],
    "remax_baseline": ["--algorithm.name=remax", "--training.batch_size=3"],
}


def parity_reward(prompt: str, completion: str, metadata: dict) -> float:
    """0 or 1 by the completion's bytes: groups of an untrained model get non-zero advantages
    (and some all-equal groups for dynamic sampling to drop)."""
    return float(sum(map(ord, completion)) % 2)


TIMING = ("time_", "tokens_per_s", "gen_compile_s", "eta_s", "straggler", "mem_", "peak_mem")
"""Metrics of time and memory: not equal between layouts."""


def run_case(case: str, cp: int, folder: str) -> dict:
    config = parse_args([*COMMON, *CASES[case], f"--parallelism.cp={cp}", f"--job.dump_folder={folder}"])
    trainer = build_trainer(config)
    recipe, out = trainer.recipe, {"generated": [], "metrics": [], "decoded": [0, 0]}
    collect, generate = recipe.rollouts.collect, recipe.generator.generate

    def recorded_collect(batches, step, timer):
        train, generated = collect(batches, step, timer)
        out["generated"].append(
            {
                "prompts": generated.prompts,
                "completions": [(c.prompt_index, c.sample_index, c.token_ids) for c in generated.completions],
                "rewards": generated.rewards,
                "baseline_rewards": generated.baseline_rewards,
                "train_prompts": train.prompts,
                "gen_tokens": generated.counts.gen_tokens,  # logged as tokens_per_s, which is a time
            }
        )
        return train, generated

    def recorded_generate(prompts, params, *args, **kwargs):
        completions, stats = generate(prompts, params, *args, **kwargs)
        out["decoded"][0] += stats.decode_tokens
        out["decoded"][1] += len(prompts)
        return completions, stats

    recipe.rollouts.collect, recipe.generator.generate = recorded_collect, recorded_generate
    recipe.prepare()
    batches = iter(recipe.loader)
    for step in (1, 2):
        metrics = recipe.step(batches, step)
        out["metrics"].append({k: v for k, v in metrics.items() if not k.startswith(TIMING)})
    out["params"] = full_params(trainer.model)
    trainer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--folder", required=True)
    cli = parser.parse_args()
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    here = os.path.dirname(os.path.abspath(__file__))  # reward workers import parity_reward from here
    os.environ["PYTHONPATH"] = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    # Trainer.close would end the process group: the cases share one (a new group per case would
    # rendezvous again under the same store keys).
    shutdown, launch.shutdown = launch.shutdown, dist.barrier
    results = {case: run_case(case, world_size, os.path.join(cli.folder, case)) for case in CASES}
    shutdown()
    if rank != 0:
        results = {case: {"decoded": r["decoded"]} for case, r in results.items()}
    torch.save(results, f"{cli.out}.{rank}")


if __name__ == "__main__":
    main()
