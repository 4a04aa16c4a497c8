"""FSDP2, TP, FSDP2+TP, HSDP (and compile/AC on top) train exactly like one rank.

Each layout runs 3 AdamW steps with gradient clipping on a tiny Qwen3-like (QK-norm, tied
embeddings) and Qwen2-like (biases, untied) model (compiled layouts: the Qwen3-like one only)
under torchrun with gloo ranks; the 1-rank reference runs in this process from the same init
and global batch.
"""

import os
import sys

import pytest
import torch
from helpers import background
from helpers.launch import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "multirank"))
import parity_worker  # noqa: E402

WORKER = os.path.join(REPO_ROOT, "tests", "multirank", "parity_worker.py")
LAUNCHES = {2: ["fsdp2", "tp2", "fsdp2_bf16", "tp2_compile"], 4: ["fsdp2_tp2", "hsdp2x2", "fsdp2_tp2_ac_compile"]}

# fp32 tolerances: reductions run in a different order on several ranks.
LOSS_ATOL, GRAD_ATOL, PARAM_ATOL = 1e-5, 1e-5, 1e-4


@pytest.fixture(scope="module")
def reference():
    return {family: parity_worker.run_layout(family, None, world_size=1) for family in parity_worker.MODEL_ARGS}


# The launches run in the background from collection on (helpers/background.py).
for _nproc, _layouts in LAUNCHES.items():
    background.register_torchrun(
        f"parity{_nproc}",
        ("tests/test_parallel_parity.py",),
        WORKER,
        _nproc,
        lambda folder, layouts=_layouts: ["--layouts", ",".join(layouts), "--out", f"{folder}/results.pt"],
    )


@pytest.fixture(scope="module")
def launched():
    results = {}
    for nproc in LAUNCHES:
        folder = background.torchrun_result(f"parity{nproc}")
        results.update(torch.load(os.path.join(folder, "results.pt")))
    return results


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


FP32_CASES = [
    (layout, family)
    for layouts in LAUNCHES.values()
    for layout in layouts
    if layout != "fsdp2_bf16"
    for family in parity_worker.families(layout)
]


@pytest.mark.multirank
@pytest.mark.parametrize("layout,family", FP32_CASES)
def test_fp32_layout_matches_one_rank(launched, reference, layout, family):
    got, ref = launched[f"{layout}/{family}"], reference[family]
    assert got["losses"] == pytest.approx(ref["losses"], abs=LOSS_ATOL)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    # Clipping is active (norm above MAX_NORM), so the cross-mesh clip is part of what is checked.
    assert min(ref["grad_norms"]) > parity_worker.MAX_NORM
    assert _max_diff(got["grads"], ref["grads"]) < GRAD_ATOL
    assert _max_diff(got["params"], ref["params"]) < PARAM_ATOL
    # The model learned something, so equal results are not equal non-results.
    assert ref["losses"][-1] < ref["losses"][0] - 0.5


@pytest.mark.multirank
@pytest.mark.parametrize("family", list(parity_worker.MODEL_ARGS))
def test_bf16_mixed_precision_close_to_fp32(launched, reference, family):
    got, ref = launched[f"fsdp2_bf16/{family}"], reference[family]
    # bf16 params in forward/backward: ~3 significant digits.
    assert got["losses"] == pytest.approx(ref["losses"], abs=5e-3)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=5e-2)
    assert got["losses"] != ref["losses"]  # bf16 really was used
