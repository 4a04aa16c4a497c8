"""Sequence packing (training.packing): the planner keeps every token once within the budget,
positions restart per document, packed logprobs / values / GRPO gradients equal the padded ones
(float32 rounding; bitwise in batch-invariant mode), and the RL recipe trains alike either way."""

import json
import os
import random

import pytest
import torch
from helpers.launch import REPO_ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from titanrl import train
from titanrl.algorithms import LossInputs, get_algorithm
from titanrl.config import load_config
from titanrl.data.batch import build_sequence_batch, micro_batches
from titanrl.data.batch_forward import forward_logprobs, forward_values
from titanrl.data.packing import (
    first_fit_decreasing,
    group_rows,
    layout_of,
    pack_layout,
    packed_micro_batches,
    plan_packed_micro_batches,
    use_packing,
)
from titanrl.models.attention import DocumentFlexAttention, DocumentSDPA
from titanrl.models.flavors import get_model_args
from titanrl.models.model import Transformer

CONFIG = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
# float32 forward of the debug model: packed and padded rows differ only in BLAS blocking.
ATOL = 1e-5


def _model(num_labels=None, seed=0):
    torch.manual_seed(seed)
    args = get_model_args("debug")
    if num_labels:
        args.num_labels = num_labels
    model = Transformer(args)
    model.init_weights()
    return model


def _batch(seed, n=10, longest=60):
    """Long-tailed rows: short prompts, most responses short, some near `longest`."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 250) for _ in range(rng.randint(1, 8))] for _ in range(n)]
    comps = [
        [rng.randrange(1, 250) for _ in range(longest if rng.random() < 0.2 else rng.randint(1, 12))] for _ in range(n)
    ]
    lps = [[-rng.random() for _ in c] for c in comps]
    return build_sequence_batch(prompts, comps, 0, lps)


def test_positions_restart_per_document_and_fields_round_trip():
    batch = build_sequence_batch([[1, 2], [3, 4, 5], [6]], [[7, 8, 9], [10], [11]], pad_id=0)
    # Inputs (tokens[:-1]): 4, 3 and 1 per row, packed into rows of 4 slots: [0], [1, 2].
    layout = pack_layout(batch["length"].tolist(), batch["tokens"].shape[1])
    assert (layout.R, layout.S) == (2, 4)
    assert layout.positions_RS.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]
    assert layout.doc_RS.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1]]
    assert layout.pack(batch["tokens"][:, :-1]).tolist() == [[1, 2, 7, 8], [3, 4, 5, 6]]
    assert layout.pack(batch["tokens"][:, 1:]).tolist() == [[2, 7, 8, 9], [4, 5, 10, 11]]
    assert layout.spans == [[(0, 4)], [(0, 3), (3, 4)]]
    # Unpacking puts every slot back; past a row's length the [B, T-1] layout holds 0.
    assert torch.equal(layout.unpack(layout.pack(batch["loss_mask"])), batch["loss_mask"])
    padded = pack_layout([3, 3], width=5)  # 2 + 2 inputs in one row of 4
    assert padded.positions_RS.tolist() == [[0, 1, 0, 1]] and padded.doc_RS.tolist() == [[0, 0, 1, 1]]
    tail = pack_layout([2, 5], width=5)  # 1 + 4 inputs: two rows, the first padded (its own document)
    assert tail.doc_RS.tolist() == [[0, 0, 0, 0], [0, 1, 1, 1]] and tail.spans[1] == [(0, 1), (1, 4)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 80), min_size=1, max_size=40), st.sampled_from([0, 64, 100, 300]), st.data())
def test_planner_keeps_every_token_once_within_the_budget(lengths, budget, data):
    lengths = [n + 1 for n in lengths]  # at least one input per document
    capacity = max(lengths) - 1
    plan = plan_packed_micro_batches(lengths, budget, None)
    docs = [b for mb in plan for row in mb for b in row]
    assert sorted(docs) == list(range(len(lengths)))
    for mb in plan:
        assert mb and all(sum(lengths[b] - 1 for b in row) <= capacity for row in mb)
        assert budget == 0 or len(mb) * capacity <= max(budget, capacity)
    assert len(plan) == 1 if budget == 0 else len(plan) >= 1
    # Another dp rank may need more micro-batches: any 1 <= n <= documents, none empty.
    n = data.draw(st.integers(1, len(lengths)))
    groups = group_rows(first_fit_decreasing([x - 1 for x in lengths], capacity), n)
    assert len(groups) == n and all(groups) and all(len(row) > 0 for g in groups for row in g)
    assert sorted(b for g in groups for row in g for b in row) == list(range(len(lengths)))
    # The layout: every real input exactly once, in slots of its own document's row.
    layout = pack_layout(lengths, max(lengths))
    assert layout.src_N.unique().numel() == layout.src_N.numel() == sum(x - 1 for x in lengths)
    assert layout.dst_N.unique().numel() == layout.dst_N.numel() and int(layout.dst_N.max()) < layout.R * layout.S


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_logprobs_and_values_match_padded(seed):
    model, batch = _model(), _batch(seed)
    assert layout_of(batch, "on").R < batch.batch_size[0]
    with torch.no_grad():
        want, want_ent = forward_logprobs(model, batch, False, 64, True, packing="off")
        got, got_ent = forward_logprobs(model, batch, False, 64, True, packing="on")
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got_ent, want_ent, atol=ATOL, rtol=0)
    assert (got[batch["loss_mask"] == 0] == 0).all()
    critic, mask = _model(num_labels=1), batch["loss_mask"]
    with torch.no_grad():
        torch.testing.assert_close(
            forward_values(critic, batch, "on") * mask, forward_values(critic, batch) * mask, atol=ATOL, rtol=0
        )


def test_flex_attention_backend_matches_sdpa_mask():
    layout = layout_of(_batch(3), "on")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(layout.R, layout.S, h, 16, generator=g) for h in (4, 2, 2))
    torch.testing.assert_close(
        DocumentFlexAttention(layout.doc_RS).attend(0, q, k, v),
        DocumentSDPA(layout.doc_RS).attend(0, q, k, v),
        atol=1e-5,
        rtol=0,
    )


def test_batch_invariant_packed_logprobs_are_bitwise_the_padded_ones():
    model, batch = _model(), _batch(5, n=4, longest=16)
    assert layout_of(batch, "on").R == 2  # 4 rows in 2
    with torch.no_grad():
        want, _ = forward_logprobs(model, batch, True, 64, packing="off")
        got, _ = forward_logprobs(model, batch, True, 64, packing="on")
    assert torch.equal(got, want)


def _grpo_step(model, algo, batch, mbs):
    model.zero_grad()
    num_tokens, num_seqs, total = batch["loss_mask"].sum().item(), float(batch.batch_size[0]), 0.0
    for mb in mbs:
        logprobs, _ = forward_logprobs(model, mb, False, 64)
        out = algo.loss(
            LossInputs(
                logprobs,
                logprobs.detach(),
                mb["advantages"],
                mb["loss_mask"],
                num_global_tokens=num_tokens,
                num_global_seqs=num_seqs,
            )
        )
        out.loss.backward()
        total += out.loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_grpo_step_loss_and_grads_packed_match_padded(loss_agg):
    config = load_config([f"--job.config_file={CONFIG}", f"--algorithm.loss_agg={loss_agg}"])
    algo = get_algorithm("grpo")(config.algorithm)
    model, batch = _model(), _batch(5, n=12)
    batch["advantages"] = torch.randn(12, generator=torch.Generator().manual_seed(0))
    want_loss, want = _grpo_step(model, algo, batch, micro_batches(batch, 3))
    packed = packed_micro_batches(batch, 2 * (batch["tokens"].shape[1] - 1), None)  # two packed rows each
    assert len(packed) > 1 and all("pack_row" in mb.keys() for mb in packed)
    assert any(int(mb["pack_row"].max()) == 1 for mb in packed)
    got_loss, got = _grpo_step(model, algo, batch, packed)
    assert got_loss == pytest.approx(want_loss, abs=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-4, msg=name)


def test_auto_packs_long_tails_only():
    assert use_packing("auto", [10] * 31 + [200])
    assert not use_packing("auto", [20, 21, 22, 21])
    assert use_packing("on", [20, 21]) and not use_packing("off", [10] * 31 + [200])


def test_packing_config_values_are_checked():
    assert load_config([f"--job.config_file={CONFIG}"]).training.packing == "auto"
    with pytest.raises(ValueError, match="packing"):
        load_config([f"--job.config_file={CONFIG}", "--training.packing=yes"])


def varied_reward(prompt: str, completion: str, metadata: dict) -> float:
    """Rewards that differ within a group (an untrained model gets 0 on the task): non-zero advantages."""
    return float(sum(map(ord, completion)) % 5)


def _rl_run(folder, packing, data):
    train.main(
        [
            f"--job.config_file={CONFIG}",
            "--training.steps=2",
            "--sft_warmup.steps=0",
            "--reward.function=test_packing:varied_reward",
            f"--data.path={data}",
            "--training.batch_size=2",
            "--algorithm.group_size=4",
            "--generator.max_new_tokens=8",
            "--data.num_eval_samples=2",
            "--reward.num_workers=1",
            "--metrics.eval_freq=0",
            "--algorithm.kl_coef=0.05",
            "--algorithm.num_minibatches=2",  # reference + old logprobs
            f"--training.packing={packing}",
            f"--job.dump_folder={folder}",
        ]
    )
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("phase") == "rl" and "reward_mean" in r]


def test_rl_recipe_with_packing_on_matches_off(tmp_path, monkeypatch):
    """Two GRPO steps (reference and old logprobs too) through the normal entry point: prompts
    of 5 to 95 characters, so that short samples share packed rows."""
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": "x" * (5 + 37 * i % 90) + f"{i}+{i}=", "answer": 2 * i}) + "\n" for i in range(12)
        )
    )
    packed_rows = []
    import titanrl.data.batch_forward as packing

    def spy(batch, mode):
        layout = layout_of(batch, mode)
        packed_rows.append(None if layout is None else (layout.R, batch.batch_size[0]))
        return layout

    monkeypatch.setattr(packing, "layout_of", spy)
    on = _rl_run(tmp_path / "on", "on", data)
    assert packed_rows and all(r is not None for r in packed_rows) and any(R < B for R, B in packed_rows)
    packed_rows.clear()
    off = _rl_run(tmp_path / "off", "off", data)
    assert packed_rows and all(r is None for r in packed_rows)
    assert [m["step"] for m in on] == [m["step"] for m in off] == [1, 2]
    for a, b in zip(on, off):
        assert a["reward_mean"] == b["reward_mean"] and a["response_len"] == b["response_len"]
        assert a["reward_std"] > 0 and a["grad_norm"] > 0  # a real update
        for key in ["grad_norm", "entropy", "kl", "gen_logprob_diff"]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


@pytest.mark.multirank
def test_two_fsdp_ranks_packing_on_matches_off(tmp_path):
    """2 FSDP ranks under torchrun with a 64-token micro-batch budget: each rank packs its own
    rollouts into several micro-batches and the ranks agree on a count (MAX all-reduce, fuller
    rows split when a rank has fewer); losses and gradients match the padded run."""
    from helpers.launch import run_train_jobs

    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": "x" * (5 + 37 * i % 90) + f"{i}+{i}=", "answer": 2 * i}) + "\n" for i in range(12)
        )
    )
    jobs = [
        [
            f"--job.config_file={CONFIG}",
            "--training.steps=2",
            "--sft_warmup.steps=0",
            "--reward.function=test_packing:varied_reward",
            f"--data.path={data}",
            "--training.batch_size=2",
            "--algorithm.group_size=4",
            "--generator.max_new_tokens=8",
            "--data.num_eval_samples=2",
            "--reward.num_workers=1",
            "--metrics.eval_freq=0",
            "--training.micro_batch_tokens=64",
            f"--training.packing={mode}",
            f"--job.dump_folder={tmp_path / mode}",
        ]
        for mode in ("on", "off")
    ]
    run_train_jobs(jobs, 2, tmp_path)  # both runs in one launch
    runs = {}
    for mode in ("on", "off"):
        with open(tmp_path / mode / "metrics.jsonl") as f:
            runs[mode] = [r for r in map(json.loads, f) if r.get("phase") == "rl" and "reward_mean" in r]
    assert [m["step"] for m in runs["on"]] == [m["step"] for m in runs["off"]] == [1, 2]
    for a, b in zip(runs["on"], runs["off"]):
        assert a["reward_mean"] == b["reward_mean"] and a["grad_norm"] > 0
        for key in ["grad_norm", "entropy", "gen_logprob_diff"]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
