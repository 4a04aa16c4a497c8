"""Paged generation on 2 and 4 gloo ranks: generator tp=1 under an FSDP2 trainer, tp=2 under TP
(also with chunked prefill) and FSDP2+TP trainers; greedy output equals a full-recompute
reference before and after a trainer update synced with `load_weights`."""

import json
import os

import pytest
from helpers import background
from helpers.launch import REPO_ROOT

WORKER = os.path.join(REPO_ROOT, "tests", "multirank", "generator_worker.py")


LAUNCHES = [(2, "fsdp2,tp2,tp2_chunked"), (4, "fsdp2_tp2")]
# In the background from collection on (helpers/background.py).
for _nproc, _layouts in LAUNCHES:
    background.register_torchrun(
        f"generator_{_nproc}",
        ("tests/test_generator_multirank.py::test_generation_matches_reference_across_ranks",),
        WORKER,
        _nproc,
        lambda folder, layouts=_layouts: ["--layouts", layouts, "--out", f"{folder}/gen.json"],
    )


@pytest.mark.multirank
@pytest.mark.parametrize("nproc,layouts", LAUNCHES)
def test_generation_matches_reference_across_ranks(nproc, layouts):
    with open(os.path.join(background.torchrun_result(f"generator_{nproc}"), "gen.json")) as f:
        results = json.load(f)
    for layout in layouts.split(","):
        per_rank = results[layout]
        assert len(per_rank) == nproc
        for r in per_rank:
            for phase in ("before", "after"):
                assert r[phase]["n"] == 6 and r[phase]["mismatches"] == 0, (layout, phase, r)
                assert r[phase]["max_lp_diff"] < 1e-5
                # Group samples share the prompt: it is prefilled once (and again after the sync).
                assert r[phase]["prefill_tokens"] == r[phase]["prompt_tokens"]
                # tp2_chunked: prompts longer than the chunk are prefilled chunk by chunk.
                assert (r[phase]["prefill_chunks"] > 0) == layout.endswith("_chunked")
        # dp ranks received different prompts, TP peers the same ones.
        assert {r["dp_rank"] for r in per_rank} == set(range(nproc // (2 if "tp2" in layout else 1)))
