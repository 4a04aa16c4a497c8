import pytest
import torch
from helpers.launch import run_torchrun

from titanrl.distributed import ParallelDims, clip_grad_norm_


def test_dp_shard_takes_the_rest():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, world_size=8)
    assert dims.dp_shard == 2 and dims.dp_size == 4 and dims.fsdp_enabled and dims.tp_enabled


@pytest.mark.parametrize(
    "degrees,world,pattern",
    [
        ((1, -1, 3), 4, r"dp_replicate \(1\) x tp \(3\) = 3 does not divide the world size 4"),
        ((1, 2, 2), 8, r"= 4, but the job runs on 8 ranks; set dp_shard = -1 or launch 4 ranks"),
        ((0, 1, 1), 1, r"dp_replicate must be >= 1"),
        ((1, -2, 1), 1, r"dp_shard must be >= 1 or -1"),
    ],
)
def test_impossible_degrees_are_clear_errors(degrees, world, pattern):
    with pytest.raises(ValueError, match=pattern):
        ParallelDims(*degrees, world_size=world)


def test_clip_grad_norm_plain_tensors_matches_torch():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    expected = [p.grad.clone() for p in params]
    total = torch.nn.utils.get_total_norm(expected)
    norm = clip_grad_norm_(params, 0.1)
    assert norm.item() == pytest.approx(total.item())
    for p, g in zip(params, expected):
        torch.testing.assert_close(p.grad, g * (0.1 / (total + 1e-6)))


@pytest.mark.multirank
def test_mesh_views_on_4_ranks(tmp_path):
    script = tmp_path / "mesh.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "from titanrl.distributed import ParallelDims, init_distributed\n"
        "rank, world = init_distributed()\n"
        "d = ParallelDims(dp_replicate=1, dp_shard=-1, tp=2, world_size=world)\n"
        "m = d.world_mesh\n"
        "print(f'RANK{rank} dp_rank={d.dp_rank} tp_rank={m[\"tp\"].get_local_rank()} '\n"
        "      f'dp_size={d.dp_mesh.size()} fsdp={d.fsdp_mesh.size()}', flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    out = run_torchrun(str(script), 4, [])
    # TP is the innermost dim: ranks 0,1 form a TP group and share data shard 0.
    for rank, (dp_rank, tp_rank) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        assert f"RANK{rank} dp_rank={dp_rank} tp_rank={tp_rank} dp_size=2 fsdp=2" in out
