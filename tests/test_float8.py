"""Float8 training through torchao (`titanrl.components.float8`): which linears are converted,
float8 numerics of a converted linear, and short trainings on 1 rank and on 2 FSDP2 gloo ranks.

torch 2.13 runs `torch._scaled_mm` with float8_e4m3fn / e5m2 operands on CPU, so these tests run
the real float8 path (not torchao's emulation). This file is also the 2-rank worker: torchrun
runs it as a script (`_worker_main`).
"""

import argparse
import contextlib
import json
import logging
import math
import os

import pytest
import torch
from helpers import background
from helpers.launch import REPO_ROOT
from helpers.tiny import tiny_model_args, tiny_qwen2_args
from torch import nn

from titanrl.components.float8 import (
    convert_to_float8,
    has_float8_all_gather,
    precompute_float8_scales,
)
from titanrl.config.training import Float8
from titanrl.models.args import TransformerModelArgs
from titanrl.models.model import Transformer

BLOCK_LINEARS = [
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
]
# Untied, so the output head is a Linear of its own that must stay in high precision.
ARGS = tiny_qwen2_args(hidden_dim=128, vocab_size=128, max_seq_len=32)
# Relative error (Frobenius) of a float8 matmul vs float32: e4m3 keeps 3 mantissa bits (rounding
# error <= 2^-4 per element), e5m2 gradients 2 bits; errors partly average out over K terms.
FLOAT8_REL_TOL = 0.15


def _float8_linear_cls() -> type:
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear


def _float8_training_tensor_cls() -> type:
    from torchao.float8 import Float8TrainingTensor

    return Float8TrainingTensor


def _meta_model(args: TransformerModelArgs = ARGS) -> Transformer:
    with torch.device("meta"):
        return Transformer(args)


def _float8_fqns(model: nn.Module) -> list[str]:
    return [fqn for fqn, m in model.named_modules() if isinstance(m, _float8_linear_cls())]


def test_block_linears_converted_output_and_embeddings_untouched():
    model = _meta_model()
    converted = convert_to_float8(model, Float8(enable=True))
    expected = [f"layers.{i}.{name}" for i in range(ARGS.n_layers) for name in BLOCK_LINEARS]
    assert sorted(converted) == sorted(expected) == sorted(_float8_fqns(model))
    assert type(model.output) is nn.Linear and type(model.tok_embeddings) is nn.Embedding
    # The bias (Qwen2's q/k/v) moves to the Float8Linear as is.
    assert model.layers["0"].attention.wq.bias is not None


def test_filter_fqns_and_output_never_converted():
    model = _meta_model()
    # An empty filter still leaves the output head alone (the loss reads its weight directly).
    converted = convert_to_float8(model, Float8(enable=True, filter_fqns=["feed_forward", "layers.1."]))
    assert sorted(converted) == sorted(f"layers.0.{n}" for n in BLOCK_LINEARS if n.startswith("attention"))
    assert "output" not in _float8_fqns(_converted(Float8(enable=True, filter_fqns=[])))


def _converted(config: Float8) -> Transformer:
    model = _meta_model()
    convert_to_float8(model, config)
    return model


@contextlib.contextmanager
def _captured(caplog):
    """caplog's handler on the "titanrl" logger, which does not propagate to the root logger's
    (titanrl/components/console.py: its lines are printed once, by its own handler)."""
    logger = logging.getLogger("titanrl")
    logger.addHandler(caplog.handler)
    try:
        yield
    finally:
        logger.removeHandler(caplog.handler)


def test_dims_not_multiple_of_16_stay_high_precision(caplog):
    args = tiny_model_args(
        qk_norm=False, tie_word_embeddings=False, n_layers=1, hidden_dim=120, vocab_size=128, max_seq_len=32
    )
    model = _meta_model(args)
    with caplog.at_level("INFO", logger="titanrl.components.float8"), _captured(caplog):
        converted = convert_to_float8(model, Float8(enable=True))
    # w1/w3 are 120x64 and w2 64x120: kept, and counted in the log.
    assert sorted(converted) == sorted(f"layers.0.{n}" for n in BLOCK_LINEARS if n.startswith("attention"))
    assert type(model.layers["0"].feed_forward.w2) is nn.Linear
    assert "4 linears converted" in caplog.text and "3 kept in high precision" in caplog.text


@pytest.mark.parametrize("fsdp_sharded", [True, False])
def test_float8_all_gather_wraps_weights_only_when_sharded(fsdp_sharded):
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    model = _meta_model()
    convert_to_float8(model, Float8(enable=True, enable_fsdp_float8_all_gather=True), fsdp_sharded=fsdp_sharded)
    # Unsharded, the wrapper (no storage of its own) would break the one-rank generator's sharing.
    assert isinstance(model.layers["0"].attention.wq.weight, WeightWithDynamicFloat8CastTensor) == fsdp_sharded
    assert has_float8_all_gather(model) == fsdp_sharded


def test_nothing_convertible_is_an_error():
    with pytest.raises(ValueError, match=r"\[float8\] no block linear was converted.*float8.enable = false"):
        convert_to_float8(_meta_model(), Float8(enable=True, filter_fqns=["layers"]))


def test_linear_subclass_in_a_block_is_rejected():
    class AdaptedLinear(nn.Linear):  # stands for LoRALinear: behaviour Float8Linear would drop
        pass

    model = _meta_model()
    with torch.device("meta"):
        model.layers["0"].attention.wq = AdaptedLinear(64, 64)
    with pytest.raises(ValueError, match=r"layers.0.attention.wq.*AdaptedLinear.*lora.enable = false"):
        convert_to_float8(model, Float8(enable=True))


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("emulate", [False, True])
def test_float8_linear_numerics(recipe, emulate):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(128, 96))
    model = nn.Sequential(nn.Linear(128, 96))
    model.load_state_dict(ref.state_dict())
    # The converter only looks below `layers.`: name the container so.
    holder = nn.Module()
    holder.layers = model
    convert_to_float8(holder, Float8(enable=True, recipe=recipe, emulate=emulate))
    assert isinstance(model[0], _float8_linear_cls())

    x_ref = torch.randn(4, 16, 128, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_(True)
    grad_out = torch.randn(4, 16, 96)
    ref(x_ref).backward(grad_out)
    out = model(x)
    out.backward(grad_out)
    y_ref = ref(x_ref).detach()
    for got, want in ((out, y_ref), (x.grad, x_ref.grad), (model[0].weight.grad, ref[0].weight.grad)):
        err = _rel_err(got, want)
        # Close at float8 precision, and not equal: the operands really were cast to float8.
        assert 1e-3 < err < FLOAT8_REL_TOL, err
    assert torch.equal(model[0].bias.grad, ref[0].bias.grad)  # the bias is added in high precision


def test_rl_run_with_float8_one_rank(tmp_path, caplog):
    from titanrl import train

    config = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
    with caplog.at_level("INFO", logger="titanrl.components.float8"), _captured(caplog):
        train.main(
            [
                f"--job.config_file={config}",
                f"--job.dump_folder={tmp_path}",
                "--float8.enable=true",
                "--training.steps=2",
                "--sft_warmup.steps=1",
                "--sft_warmup.batch_size=8",
                "--training.batch_size=2",
                "--algorithm.group_size=2",
                "--generator.max_new_tokens=6",
                "--data.num_eval_samples=8",
                "--reward.num_workers=1",
                "--metrics.eval_freq=0",
            ]
        )
    # The debug flavor's 4 blocks x 7 projections, all multiples of 16, in the policy.
    assert "float8: 28 linears converted" in caplog.text, caplog.text
    with open(tmp_path / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    sft = [m["sft_loss"] for m in metrics if "sft_loss" in m]
    rl = [m for m in metrics if m.get("phase") == "rl" and "reward_mean" in m]
    assert sft and all(math.isfinite(v) for v in sft)
    assert [m["step"] for m in rl] == [1, 2]
    for m in rl:
        assert all(math.isfinite(m[k]) for k in ("grad_norm", "kl", "entropy", "gen_logprob_diff")), m
        # The generator samples in high precision from the same weights: close, not equal.
        assert m["gen_logprob_diff"] < 0.1


# ---- 2 FSDP2 gloo ranks (this file is the worker) ----

WORKER_STEPS = 3


def _train_tiny(float8: Float8 | None, dp_shard: int, world_size: int, precompute: bool = False) -> dict:
    """3 AdamW steps of the tiny model on `dp_shard` ranks; the global losses and the weights a
    plain generator model receives from `copy_trainer_weights`, vs the trainer's full state dict."""
    import torch.distributed as dist

    from titanrl.components.loss import global_token_count, sft_loss
    from titanrl.components.model_builder import build_model, full_state_dict, init_full_state_dict
    from titanrl.config.job_config import JobConfig
    from titanrl.distributed import ParallelDims
    from titanrl.generator.weight_sync import copy_trainer_weights
    from titanrl.models.logprobs import token_logprobs

    job_config = JobConfig()
    if float8 is not None:
        job_config.float8 = float8
    dims = ParallelDims(1, dp_shard, 1, world_size)
    model = build_model(ARGS, dims, job_config, torch.device("cpu"), full_state_dict=init_full_state_dict(ARGS, 0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens_BT = torch.randint(0, ARGS.vocab_size, (8, 17), generator=torch.Generator().manual_seed(1))
    rows = slice(dims.dp_rank * 8 // dims.dp_size, (dims.dp_rank + 1) * 8 // dims.dp_size)
    inputs_BT, targets_BT, mask_BT = tokens_BT[rows, :-1], tokens_BT[rows, 1:], torch.ones(8 // dims.dp_size, 16)
    group = dims.dp_mesh.get_group() if dims.dp_size > 1 else None
    losses = []
    for _ in range(WORKER_STEPS):
        optimizer.zero_grad()
        loss = sft_loss(token_logprobs(model(inputs_BT), targets_BT), mask_BT, global_token_count(mask_BT, group))
        loss.backward()
        optimizer.step()
        if precompute:
            precompute_float8_scales(model, job_config.float8)
        global_loss = loss.detach().clone()
        if group is not None:
            dist.all_reduce(global_loss, group=group)
        losses.append(global_loss.item())
    # A forward-only use (the reference's) must leave every weight readable (sharded, not float8).
    with torch.no_grad():
        model(inputs_BT)
    readable = all(
        not isinstance(p.to_local() if hasattr(p, "to_local") else p, _float8_training_tensor_cls())
        for p in model.parameters()
    )
    generator_model = Transformer(ARGS)
    copy_trainer_weights(generator_model, model)
    want = full_state_dict(model)
    got = generator_model.state_dict()
    sync_err = max((got[k] - want[k].float()).abs().max().item() for k in want)
    return {
        "losses": losses,
        "sync_err": sync_err,
        "readable_after_forward": readable,
        "has_float8_all_gather": has_float8_all_gather(model),
    }


WORKER_CASES = {
    "high_precision": lambda: None,
    "float8": lambda: Float8(enable=True),
    "float8_all_gather": lambda: Float8(enable=True, enable_fsdp_float8_all_gather=True),
    "float8_all_gather_precompute": lambda: Float8(enable=True, enable_fsdp_float8_all_gather=True),
}


def _worker_main() -> None:
    import torch.distributed as dist

    from titanrl.distributed import init_distributed

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    rank, world_size = init_distributed()
    results = {
        name: _train_tiny(make(), world_size, world_size, precompute=name.endswith("precompute"))
        for name, make in WORKER_CASES.items()
    }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


# In the background from collection on (helpers/background.py).
background.register_torchrun(
    "float8_fsdp",
    ("tests/test_float8.py::test_fsdp2_",),
    os.path.abspath(__file__),
    2,
    lambda folder: ["--out", f"{folder}/results.json"],
)


@pytest.fixture(scope="module")
def fsdp_results() -> dict:
    with open(os.path.join(background.torchrun_result("float8_fsdp", timeout_s=300), "results.json")) as f:
        return json.load(f)


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["float8", "float8_all_gather", "float8_all_gather_precompute"])
def test_fsdp2_float8_trains_like_high_precision(fsdp_results, case):
    ref, got = fsdp_results["high_precision"]["losses"], fsdp_results[case]["losses"]
    assert all(math.isfinite(v) for v in got)
    # Same trajectory at float8 precision; and a different one (the matmuls were float8).
    assert got == pytest.approx(ref, abs=2e-2)
    assert got != ref
    assert got[-1] < got[0] - 0.5


@pytest.mark.multirank
def test_fsdp2_float8_all_gather_matches_per_weight_scales(fsdp_results):
    # One all-reduce for all scales after each step == one all-reduce per weight at the gather.
    assert fsdp_results["float8_all_gather_precompute"]["losses"] == pytest.approx(
        fsdp_results["float8_all_gather"]["losses"], abs=1e-6
    )
    assert fsdp_results["float8_all_gather"]["losses"] == pytest.approx(fsdp_results["float8"]["losses"], abs=1e-6)


@pytest.mark.multirank
def test_fsdp2_float8_weight_sync_exact(fsdp_results):
    assert fsdp_results["float8"]["sync_err"] == 0.0


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(WORKER_CASES))
def test_fsdp2_weights_readable_after_a_forward(fsdp_results, case):
    assert fsdp_results[case]["readable_after_forward"]
    assert fsdp_results[case]["has_float8_all_gather"] == ("all_gather" in case)


@pytest.mark.multirank
def test_fsdp2_float8_all_gather_weight_sync_exact(fsdp_results):
    # FSDP2's unshard would give float8-cast weights (error ~4e-3): the sync gathers the
    # high-precision shards instead (weight_sync.copy_trainer_weights).
    assert fsdp_results["float8_all_gather"]["sync_err"] == 0.0


if __name__ == "__main__":
    _worker_main()
