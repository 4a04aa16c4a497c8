"""Expert parallelism (and FSDP2 / TP around it) trains a mixture of experts exactly like one rank.

A tiny MoE model (one MoE layer with a shared expert, one dense layer) runs 2 AdamW steps with
gradient clipping under ep = 2 on 2 ranks, ep = 2 x FSDP2 over dp_shard / ep = 2 on 4 ranks, and
ep = 2 with tp = 2 for attention and the dense layer on 4 ranks (torchrun, gloo), in float32 and
float64; the 1-rank reference runs in this process from the same init and global batch.
"""

import os
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from helpers.launch import REPO_ROOT, run_torchrun

from titanrl.components.checkpoint import CheckpointManager
from titanrl.components.model_builder import build_model
from titanrl.config.job_config import JobConfig
from titanrl.distributed.expert_parallel import regroup_index
from titanrl.distributed.parallel_dims import ParallelDims
from titanrl.models.model import Transformer
from titanrl.trainer import Trainer

sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "multirank"))
import moe_parity_worker  # noqa: E402
import parity_worker  # noqa: E402

WORKER = os.path.join(REPO_ROOT, "tests", "multirank", "moe_parity_worker.py")
LAUNCHES = {2: ["ep2"], 4: ["ep2_dp4", "ep2_tp2"]}
TOLERANCES = {"float32": 1e-5, "float64": 1e-10}


@pytest.fixture(scope="module")
def reference():
    return {dtype: moe_parity_worker.run_layout(None, dtype, world_size=1) for dtype in moe_parity_worker.DTYPES}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    results = {"ckpt": str(tmp_path_factory.mktemp("moe_ckpt"))}
    for nproc, layouts in LAUNCHES.items():
        out = tmp_path_factory.mktemp(f"moe{nproc}") / "results.pt"
        run_torchrun(WORKER, nproc, ["--layouts", ",".join(layouts), "--out", str(out), "--ckpt", results["ckpt"]])
        results.update(torch.load(out))
    return results


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("layout", [layout for layouts in LAUNCHES.values() for layout in layouts])
def test_expert_parallel_layout_matches_one_rank(launched, reference, layout, dtype):
    got, ref, tol = launched[f"{layout}/{dtype}"], reference[dtype], TOLERANCES[dtype]
    assert got["losses"] == pytest.approx(ref["losses"], abs=tol)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], abs=tol)
    assert min(ref["grad_norms"]) > parity_worker.MAX_NORM  # clipping is active (train_steps clips to it)
    assert _max_diff(got["grads"], ref["grads"]) < tol
    assert _max_diff(got["params"], ref["params"]) < tol
    assert ref["losses"][1] < ref["losses"][0] - 0.1  # the steps did something
    assert ref["params"]["layers.0.moe.experts.w1"].shape[0] == moe_parity_worker.MOE_ARGS.moe_num_experts


@pytest.mark.multirank
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP without a process group
def test_ep2_checkpoint_loads_on_one_rank(launched):
    """Resharding ep = 2 -> 1: the DCP checkpoint of the 2-rank run (experts as ep x FSDP2
    DTensor shards) loads into an unsharded model: its parameters, and AdamW's state for them."""
    model = build_model(moe_parity_worker.MOE_ARGS, ParallelDims(1, 1, 1, 1), JobConfig(), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    path = CheckpointManager(launched["ckpt"], keep_latest_k=0).step_dir(moe_parity_worker.STEPS)
    CheckpointManager(launched["ckpt"], keep_latest_k=0).load(path, {"model": model}, {"model": optimizer})
    saved = launched["ep2/float32"]["params"]
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), saved[name]), name
    w1 = model.get_parameter("layers.0.moe.experts.w1")
    assert optimizer.state[w1]["step"].item() == moe_parity_worker.STEPS
    assert optimizer.state[w1]["exp_avg"].abs().sum() > 0


def test_regroup_index_orders_rows_by_local_expert():
    # 2 source ranks x 3 local experts; rows arrive (source, expert)-major.
    counts_RL = torch.tensor([[2, 0, 1], [1, 3, 0]])
    labels = [(r, e) for r in range(2) for e in range(3) for _ in range(int(counts_RL[r, e]))]
    regrouped = [labels[i] for i in regroup_index(counts_RL).tolist()]
    assert regrouped == sorted(labels, key=lambda rl: (rl[1], rl[0]))


def test_ep_degree_is_checked_against_dp_shard():
    with pytest.raises(ValueError, match=r"ep \(4\) must divide dp_shard \(2\)"):
        ParallelDims(1, 2, 1, 2, ep=4)
    with pytest.raises(ValueError, match="ep must be >= 1"):
        ParallelDims(1, -1, 1, 2, ep=0)
    assert ParallelDims(1, -1, 1, 4, ep=2).dp_shard == 4


def _tiny_moe(**overrides) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(replace(moe_parity_worker.MOE_ARGS, **overrides))
    model.init_weights()
    return model


def test_aux_loss_coeff_adds_the_load_balancing_gradient():
    tokens_BT = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    grads = []
    for coeff in (0.0, 0.3):
        model = _tiny_moe()
        model.moe_layers()[0].aux_loss_coeff = coeff
        loss = model(tokens_BT).logsumexp(-1).mean()
        if coeff == 0.0:
            loss = loss + 0.3 * model.moe_aux_loss()  # the term written out: one MoE layer
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert grads[0]["layers.0.moe.router.gate.weight"].abs().max() > 0
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_trainer_moe_config_sets_coefficients_and_moves_the_bias():
    config = JobConfig()
    config.moe.aux_loss_coeff, config.moe.bias_update_rate = 0.01, 0.1
    host = SimpleNamespace(config=config, dims=SimpleNamespace(dp_size=2), dp_group=None)
    dense = Transformer(replace(moe_parity_worker.MOE_ARGS, moe_num_experts=0))
    with pytest.raises(ValueError, match=r"\[moe\] bias_update_rate = 0.1 needs .* no MoE layers"):
        Trainer.configure_moe(host, dense)
    with pytest.raises(ValueError, match="no expert bias"):
        Trainer.configure_moe(host, _tiny_moe())
    model = _tiny_moe(moe_expert_bias=True)
    Trainer.configure_moe(host, model)
    layer = model.moe_layers()[0]
    assert layer.aux_loss_coeff == pytest.approx(0.01 / 2)  # one MoE layer, 2 dp ranks
    layer.tokens_per_expert.copy_(torch.tensor([5.0, 1, 1, 1, 1, 1, 1, 5]))
    Trainer.update_expert_biases(host, model)
    assert layer.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, -0.1])
    assert layer.tokens_per_expert.sum() == 0
