"""Train a tiny model a few steps under several parallel layouts; rank 0 saves the results.

Launched by tests/test_parallel_parity.py with torchrun (2 or 4 gloo ranks); `run_layout` also
runs in-process as the 1-rank reference. Every layout starts from the same full state dict and
sees the same global batch, split by dp rank.
"""

import argparse

import torch
import torch.distributed as dist

from tests.helpers.tiny import tiny_model_args, tiny_qwen2_args
from titanrl.components.loss import global_token_count, sft_loss
from titanrl.components.model_builder import build_model, init_full_state_dict
from titanrl.config.job_config import JobConfig
from titanrl.distributed import ParallelDims, clip_grad_norm_, init_distributed
from titanrl.models.logprobs import token_logprobs

STEPS = 3
GLOBAL_BATCH, SEQ_LEN = 8, 16
# Small clip threshold so that clipping is active and its cross-mesh norm is exercised.
MAX_NORM = 0.5

MODEL_ARGS = {
    # Qwen3-like: QK-norm, GQA, tied embeddings.
    "qwen3": tiny_model_args(hidden_dim=128, vocab_size=128, max_seq_len=32),
    # Qwen2-like: q/k/v biases, untied output.
    "qwen2": tiny_qwen2_args(hidden_dim=128, vocab_size=128, max_seq_len=32),
}

# name -> (dp_replicate, dp_shard, tp, overrides of JobConfig sections)
COMPILE = {"compile": {"enable": True, "backend": "inductor"}}
LAYOUTS = {
    "fsdp2": (1, 2, 1, {}),
    "tp2": (1, 1, 2, {}),
    "fsdp2_bf16": (1, 2, 1, {"training": {"mixed_precision_param": "bfloat16"}}),
    "tp2_compile": (1, 1, 2, COMPILE),
    "fsdp2_tp2": (1, 2, 2, {}),
    "hsdp2x2": (2, 2, 1, {}),
    "fsdp2_tp2_ac_compile": (1, 2, 2, {"activation_checkpoint": {"mode": "selective"}, **COMPILE}),
}


def families(layout: str) -> list[str]:
    """Model families a layout runs: compiled layouts (~2/3 of this module's time, mostly
    inductor) only on the Qwen3-like model, whose QK-norm and tied embedding are the harder
    case; the eager layouts cover both."""
    return ["qwen3"] if "compile" in layout else list(MODEL_ARGS)


def train_steps(model, optimizer, batch, dp_group, steps: int) -> tuple[list[float], list[float]]:
    """`steps` SFT optimizer steps on this rank's rows (inputs, targets, mask), gradients clipped
    to MAX_NORM: the global loss and the gradient norm of each step."""
    inputs_BT, targets_BT, mask_BT = batch
    losses, grad_norms = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        num_tokens = global_token_count(mask_BT, dp_group)
        loss = sft_loss(token_logprobs(model(inputs_BT), targets_BT), mask_BT, num_tokens)
        loss.backward()
        grad_norms.append(clip_grad_norm_(list(model.parameters()), MAX_NORM).item())
        global_loss = loss.detach().clone()
        if dp_group is not None:
            dist.all_reduce(global_loss, group=dp_group)
        losses.append(global_loss.item())
        optimizer.step()
    return losses, grad_norms


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    tokens_BT = torch.randint(0, 128, (GLOBAL_BATCH, SEQ_LEN + 1), generator=g)
    lengths_B = torch.randint(3, SEQ_LEN + 1, (GLOBAL_BATCH,), generator=g)
    mask_BT = (torch.arange(SEQ_LEN)[None, :] < lengths_B[:, None]).float()
    return tokens_BT, mask_BT


def run_layout(family: str, layout: str | None, world_size: int) -> dict:
    dp_replicate, dp_shard, tp, overrides = LAYOUTS[layout] if layout else (1, 1, 1, {})
    job_config = JobConfig()
    for section, values in overrides.items():
        for key, value in values.items():
            setattr(getattr(job_config, section), key, value)
    parallel_dims = ParallelDims(dp_replicate, dp_shard, tp, world_size)
    model_args = MODEL_ARGS[family]
    model = build_model(
        model_args,
        parallel_dims,
        job_config,
        torch.device("cpu"),
        full_state_dict=init_full_state_dict(model_args, seed=0),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    dp_group = parallel_dims.dp_mesh.get_group() if parallel_dims.dp_size > 1 else None

    tokens_BT, mask_BT = make_batch()
    local_B = GLOBAL_BATCH // parallel_dims.dp_size
    rows = slice(parallel_dims.dp_rank * local_B, (parallel_dims.dp_rank + 1) * local_B)
    inputs_BT, targets_BT, mask_BT = tokens_BT[rows, :-1], tokens_BT[rows, 1:], mask_BT[rows]

    losses, grad_norms = train_steps(model, optimizer, (inputs_BT, targets_BT, mask_BT), dp_group, STEPS)

    # Full (unsharded) parameters and last-step gradients, keyed by state-dict name.
    params, grads = {}, {}
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
        params[name] = full(p.detach()).clone()
        grads[name] = full(p.grad).clone()
    return {"losses": losses, "grad_norms": grad_norms, "params": params, "grads": grads}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    rank, world_size = init_distributed()
    results = {}
    for layout in cli.layouts.split(","):
        for family in families(layout):
            results[f"{layout}/{family}"] = run_layout(family, layout, world_size)
    if rank == 0:
        torch.save(results, cli.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
