"""One RL update (GRPO, packed micro-batches) and one SFT step, twice, under context parallelism;
rank 0 saves the results.

Launched by tests/test_context_parallel.py with torchrun (2 or 4 gloo ranks); `run_case` also
runs in-process as the 1-rank reference. The RL update is the recipe's own `update_policy` and
the SFT step the recipe's own `sft_step`, on a host object that borrows the Trainer's methods,
so the code under test is the code a job runs (the generator is not context-parallel and not
part of this).
"""

import argparse
import random

import torch
import torch.distributed as dist
from tensordict import TensorDict

from titanrl.algorithms import get_algorithm
from titanrl.components.model_builder import build_model, init_full_state_dict
from titanrl.components.watchdog import Watchdog
from titanrl.config.job_config import JobConfig
from titanrl.data.batch import build_sequence_batch
from titanrl.data.batch_forward import forward_logprobs
from titanrl.data.encode import PromptEncoder
from titanrl.data.tasks import Reverse
from titanrl.distributed import ParallelDims, init_distributed
from titanrl.distributed.context_parallel import check_same_rows, shard_plan
from titanrl.models.args import TransformerModelArgs
from titanrl.models.tokenizer import build_tokenizer
from titanrl.recipes.rl_recipe import RLRecipe
from titanrl.recipes.sft import sft_step
from titanrl.rl.stats import RLStats
from titanrl.trainer import Trainer

STEPS = 2
GLOBAL_ROWS = 8
ARGS = TransformerModelArgs(
    family="qwen3",
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    hidden_dim=64,
    vocab_size=264,
    qk_norm=True,
    tie_word_embeddings=True,
    max_seq_len=128,
)
# name -> (dp_shard, cp, tp, extra settings)
LAYOUTS = {
    "cp2": (1, 2, 1, {}),
    "cp2_ac": (1, 2, 1, {"activation_checkpoint": {"mode": "full"}}),
    "dp2_cp2": (2, 2, 1, {}),
    "cp2_tp2": (1, 2, 2, {}),
}
CASES = [(agg, dtype) for agg in ("token-mean", "seq-mean-token-mean") for dtype in ("float32", "float64")]


class Host:
    """What `update_policy` and `sft_step` use of a Trainer: its own methods, on this state."""

    optimizer_step = Trainer.optimizer_step
    update_expert_biases = Trainer.update_expert_biases
    dp_sum = Trainer.dp_sum
    plan_micro_batches = Trainer.plan_micro_batches

    def __init__(self, config: JobConfig, model, dp_group) -> None:
        self.config, self.model, self.dp_group = config, model, dp_group
        # Adam divides by sqrt(v): an element whose gradient is near 0 turns float32 rounding of
        # that gradient into an lr-sized step; lr 1e-3 keeps that under the 1e-5 the test checks.
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        self.tokenizer = build_tokenizer("byte")
        self.encode_prompt = PromptEncoder.from_config(config.data, "byte", self.tokenizer)
        self.device = torch.device("cpu")
        self.local_loss = 0.0
        self.watchdog = Watchdog(0, dist.get_rank() if dist.is_initialized() else 0)
        self.ft, self.ft_active = None, False  # no [fault_tolerance] replica groups

    def backward(self, loss: torch.Tensor, step: int) -> None:
        self.local_loss += loss.item()
        Trainer.backward(self, loss, step)


class RLPart:
    """The attributes of an RL recipe that `update_policy` and `micro_batches` read."""

    def __init__(self, config: JobConfig, host: Host) -> None:
        self.config, self.trainer, self.policy = config, host, host.model
        self.algorithm = get_algorithm("grpo")(config.algorithm)
        self.reference, self.distiller, self.replay = True, None, False
        self.moe = type("NoMoE", (), {"observe": lambda *a: None})()


def job_config(layout: str | None, loss_agg: str) -> JobConfig:
    config = JobConfig()
    config.algorithm.loss_agg = loss_agg
    config.algorithm.kl_coef = 0.05
    config.training.packing = "on"
    config.training.micro_batch_tokens = 96  # several packed micro-batches
    config.training.max_norm = 0.5
    for section, values in (LAYOUTS[layout][3] if layout else {}).items():
        for key, value in values.items():
            setattr(getattr(config, section), key, value)
    return config


def rl_batch(dtype: torch.dtype) -> TensorDict:
    """The global RL batch: prompts and completions of varied lengths, logprobs and advantages."""
    g = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 250) for _ in range(rng.randint(3, 20))] for _ in range(GLOBAL_ROWS)]
    completions = [[rng.randrange(1, 250) for _ in range(rng.randint(2, 30))] for _ in range(GLOBAL_ROWS)]
    batch = build_sequence_batch(prompts, completions, 0, None, None)
    B, T1 = batch["loss_mask"].shape
    batch["gen_logprobs"] = -torch.rand(B, T1, generator=g, dtype=dtype) * 6
    batch["ref_logprobs"] = batch["gen_logprobs"] + 0.1 * torch.randn(B, T1, generator=g, dtype=dtype)
    batch["advantages"] = torch.randn(B, generator=g, dtype=dtype)
    return batch


def rl_steps(part: RLPart, batch: TensorDict, dims: ParallelDims) -> dict:
    """STEPS updates of this rank's rows; old logprobs from a no-grad forward (also sharded)."""
    mine = batch[torch.arange(dims.dp_rank, GLOBAL_ROWS, dims.dp_size)]
    out = {"losses": [], "grad_norms": [], "stats": []}
    host = part.trainer
    for step in range(1, STEPS + 1):
        with torch.no_grad():
            old, _ = forward_logprobs(part.policy, mine, False, 16, packing="on")
        mine["old_logprobs"] = (old + 0.05 * mine["ref_logprobs"].sin()) * mine["loss_mask"]
        stats, host.local_loss = RLStats(), 0.0
        out["grad_norms"].append(RLRecipe.update_policy(part, mine, True, stats, step))
        out["losses"].append(host.dp_sum([host.local_loss])[0])
        out["stats"].append(dataclasses_dict(stats.reduced(host.dp_group)))
    return out


def dataclasses_dict(stats) -> dict[str, float]:
    import dataclasses

    return {f.name: float(getattr(stats, f.name)) for f in dataclasses.fields(stats)}


def sft_steps(host: Host, dims: ParallelDims) -> dict:
    rng = random.Random(3)
    task = Reverse(min_len=8, max_len=40)
    samples = [task.make(rng) for _ in range(GLOBAL_ROWS)]
    mine = samples[dims.dp_rank :: dims.dp_size]
    return {"sft": [sft_step(host, host.model, host.optimizer, mine, step) for step in range(1, STEPS + 1)]}


def full_params(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name.replace("_checkpoint_wrapped_module.", "")] = (
            t.full_tensor() if hasattr(t, "full_tensor") else t
        ).clone()
    return out


def run_case(layout: str | None, loss_agg: str, dtype: str, world_size: int, what: str) -> dict:
    dp_shard, cp, tp, _ = LAYOUTS[layout] if layout else (1, 1, 1, {})
    config = job_config(layout, loss_agg)
    dims = ParallelDims(1, dp_shard, tp, world_size, cp=cp)
    torch_dtype = getattr(torch, dtype)
    sd = {k: v.to(torch_dtype) for k, v in init_full_state_dict(ARGS, seed=0).items()}
    torch.set_default_dtype(torch_dtype)  # the model's parameters and buffers
    try:
        model = build_model(ARGS, dims, config, torch.device("cpu"), full_state_dict=sd)
    finally:
        torch.set_default_dtype(torch.float32)
    host = Host(config, model, dims.dp_mesh.get_group() if dims.dp_size > 1 else None)
    if what == "rl":
        out = rl_steps(RLPart(config, host), rl_batch(torch_dtype), dims)
    else:
        out = sft_steps(host, dims)
    out["params"] = full_params(model)
    return out


def diverged_rows_raise(rank: int, world_size: int) -> bool:
    """Equal rows pass the cp ranks' check; rows that differ on one rank raise on every rank."""
    plan = shard_plan(8, world_size, rank, None)
    check_same_rows(torch.ones(2, 8), plan)
    try:
        check_same_rows(torch.ones(2, 8) * (1 + (rank == 0)), plan)
    except RuntimeError:
        return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    rank, world_size = init_distributed()
    results = {}
    for layout in cli.layouts.split(","):
        for loss_agg, dtype in CASES:
            results[f"{layout}/rl/{loss_agg}/{dtype}"] = run_case(layout, loss_agg, dtype, world_size, "rl")
        for dtype in ("float32", "float64"):
            results[f"{layout}/sft/{dtype}"] = run_case(layout, "token-mean", dtype, world_size, "sft")
    results["diverged_raises"] = diverged_rows_raise(rank, world_size)
    if rank == 0:
        torch.save(results, cli.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
