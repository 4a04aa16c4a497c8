"""The generator with experts sharded over ep = 2 ranks (`generator/ep_lockstep.py`) generates
what an unsharded generator does: 2 gloo ranks with different prompts, prompt lengths, sample
counts and max_new_tokens (so one rank finishes first and serves the other's all-to-alls with
forwards over zero tokens), greedy tokens and recorded routes equal those of a 1-rank generator
holding all experts, on the same prompts, on every rank."""

import os

import pytest
import torch
from helpers import background
from helpers.launch import REPO_ROOT

WORKER = os.path.join(REPO_ROOT, "tests", "multirank", "moe_generator_worker.py")


# In the background from collection on (helpers/background.py).
background.register_torchrun(
    "moe_gen_ep", ("tests/test_moe_generator_ep.py",), WORKER, 2, lambda f: ["--out", f"{f}/gen.pt"]
)


@pytest.fixture(scope="module")
def per_rank():
    # A broken lockstep deadlocks the ranks: the timeout turns that into a failure.
    out = os.path.join(background.torchrun_result("moe_gen_ep", timeout_s=180), "gen.pt")
    return [torch.load(f"{out}.{rank}") for rank in range(2)]


@pytest.mark.multirank
def test_ep_sharded_generator_equals_unsharded_generator(per_rank):
    for rank, out in enumerate(per_rank):
        assert out["local_experts"] == 4  # 8 experts over ep = 2: no rank holds them all
        sharded, whole = out["sharded"], out["whole"]
        assert len(sharded) == len(whole) == (6 if rank == 0 else 10)
        for got, want in zip(sharded, whole):
            assert got["tokens"] == want["tokens"]
            assert torch.equal(got["routes"], want["routes"])  # every fed token, every MoE layer


@pytest.mark.multirank
def test_rank_that_finishes_first_serves_its_peers_forwards(per_rank):
    """Rank 0 has fewer, shorter prompts and 4 new tokens against 10: it runs idle forwards."""
    assert per_rank[0]["idle_forwards"] > 0


@pytest.mark.multirank
def test_rank_without_prompts_serves_its_peer(per_rank):
    """Rank 0 generates nothing while rank 1 generates one prompt: no deadlock, same result."""
    assert per_rank[0]["one_sided"] == []
    got, want = per_rank[1]["one_sided"], per_rank[1]["whole"][:2]
    assert [c["tokens"] for c in got] == [c["tokens"] for c in want]
    assert all(torch.equal(a["routes"], b["routes"]) for a, b in zip(got, want, strict=True))


@pytest.mark.multirank
def test_call_refused_on_one_rank_stops_every_rank(per_rank):
    """An ep-sharded generator call refused on one rank (an empty prompt) -> that rank raises its
    error, its peer raises that a peer refused instead of waiting forever; the next call works."""
    assert "prompt 0 is empty" in per_rank[1]["refused"]
    assert "refused on another ep rank" in per_rank[0]["refused"]
    for out in per_rank:
        assert [c["tokens"] for c in out["after_refusal"]] == [c["tokens"] for c in out["sharded"]]
