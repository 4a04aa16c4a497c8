"""Routing replay and MoE metrics in the RL loop (one rank): the generator records each MoE
layer's experts per fed token, the batch carries them, `[moe] routing_replay = "rollout"` makes
the trainer route by them; LoRA / float8 / quantised rollout on MoE work or fail at load."""

import dataclasses
import json
import os

import pytest
import torch
from helpers.launch import REPO_ROOT

from titanrl import train
from titanrl.components.float8 import convert_to_float8
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.config.model import LoRA
from titanrl.config.training import Float8
from titanrl.data.batch import build_sequence_batch
from titanrl.data.batch_forward import forward_logprobs, routes_in_rows
from titanrl.data.packing import layout_of
from titanrl.generator import Generator, SamplingParams
from titanrl.models import Transformer, get_model_args
from titanrl.models.batch_invariant import ExactCausalAttention, batch_invariant_mode
from titanrl.models.lora import add_lora
from titanrl.rl.moe_replay import MoEMonitor, routes_batch

ARGS = dataclasses.replace(get_model_args("debug-moe"), moe_expert_bias=True, n_layers=3, moe_mlp_only_layers=[2])
CPU = torch.device("cpu")


def _policy(bias_scale: float) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights(buffer_device=CPU)
    g = torch.Generator().manual_seed(3)
    for moe in model.moe_layers():  # a real bias: routing differs from the router's own top-k
        moe.expert_bias.copy_(bias_scale * torch.randn(moe.num_experts, generator=g))
    return model


@pytest.fixture(scope="module")
def rollout():
    """A batch-invariant generator's samples of a policy whose expert bias steers routing."""
    model = _policy(0.01)
    gen = Generator(ARGS, GeneratorConfig(block_size=4, num_blocks=256, batch_invariant=True), CPU)
    gen.load_weights(model)  # parameters and the expert_bias buffers
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (3, 7, 12, 5)]
    completions, _ = gen.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0, n=2, seed=0))
    return model, prompts, completions


def _batch(prompts, completions):
    ps = [prompts[c.prompt_index] for c in completions]
    batch = build_sequence_batch(ps, [c.token_ids for c in completions], 0, [c.logprobs for c in completions])
    batch["routes"] = routes_batch([len(p) for p in ps], completions, batch["tokens"].shape[1])
    return batch


def test_generator_records_the_trainer_routes_in_batch_invariant_mode(rollout):
    model, prompts, completions = rollout
    for c in completions:
        seq = prompts[c.prompt_index] + c.token_ids
        assert c.routes.shape == (len(seq) - 1, 2, ARGS.moe_top_k) and (c.routes >= 0).all()
        with torch.no_grad(), batch_invariant_mode():
            model(torch.tensor([seq[:-1]]), backend=ExactCausalAttention())
        trainer_LTK = model.moe_routes()
        assert torch.equal(c.routes.long().transpose(0, 1).sort(-1).values, trainer_LTK.sort(-1).values)
    # The same check as the logged metric: no (token, layer) decision differs.
    monitor = MoEMonitor(model)
    batch = _batch(prompts, completions)
    with torch.no_grad():
        forward_logprobs(model, batch, True, 64)
    monitor.observe(model, batch)
    metrics = monitor.metrics(None)
    assert metrics["moe_route_disagree"] == 0.0 and monitor is not None
    assert set(metrics) >= {"moe_router_entropy", "moe_aux_loss", "moe_load_max_mean", "moe_load_max_mean_l1"}


@pytest.mark.parametrize("packing", ["off", "on"])
def test_replay_makes_the_on_policy_ratio_exactly_one(rollout, packing):
    """The trainer's expert bias moved after sampling (as a bias update does): its routers now
    choose other experts for some tokens. Replaying the generator's routes gives the trainer the
    generator's experts for every (token, layer) and logprobs equal to the sampler's bit for bit
    (float32, batch-invariant); without replay the ratio pi_trainer / pi_gen is not 1."""
    model, prompts, completions = rollout
    batch = _batch(prompts, completions)
    mask = batch["loss_mask"] > 0
    monitor = MoEMonitor(model)
    saved = [m.expert_bias.clone() for m in model.moe_layers()]
    try:
        for moe in model.moe_layers():
            moe.expert_bias.mul_(-1.0)
        ratios, disagree = {}, {}
        for replay in (True, False):
            with torch.no_grad():
                lp, _ = forward_logprobs(model, batch, True, 64, packing=packing, replay_routes=replay)
            monitor.observe(model, batch, packing)
            disagree[replay] = monitor.metrics(None)["moe_route_disagree"]
            ratios[replay] = torch.exp(lp - batch["gen_logprobs"])[mask]
    finally:
        for moe, bias in zip(model.moe_layers(), saved):
            moe.expert_bias.copy_(bias)
    assert disagree[True] == 0.0 and disagree[False] > 0.0
    assert torch.equal(ratios[True], torch.ones_like(ratios[True]))
    assert (ratios[False] != 1.0).any()


def _reference_sums(monitor, model, batch, packing) -> torch.Tensor:
    """What `MoEMonitor.observe` adds, the plain way (boolean indexing, bincount; float64): the
    decisions, disagreements, entropy, aux loss, 1 forward, then the [L, E] loads."""
    gen_NLK = routes_in_rows(batch["routes"], layout_of(batch, packing)).long()
    valid_N = (gen_NLK >= 0).all(-1).all(-1)
    trainer_NLK = model.moe_routes().transpose(0, 1)[valid_N].long()
    differ_NL = (trainer_NLK.sort(-1).values != gen_NLK[valid_N].sort(-1).values).any(-1)
    entropy = sum(
        -(p.double() * p.double().clamp_min(1e-30).log()).sum() for p in (q[valid_N] for q in monitor._probs.values())
    )
    loads = [
        torch.bincount(trainer_NLK[:, layer].flatten(), minlength=monitor.num_experts)
        for layer in range(len(monitor.routers))
    ]
    sums = [differ_NL.numel(), differ_NL.sum().item(), entropy.item(), model.moe_aux_loss().item(), 1.0]
    return torch.cat([torch.tensor(sums, dtype=torch.float64), torch.stack(loads).double().flatten()])


def test_moe_metrics_equal_a_float64_reference_over_micro_batches(rollout):
    """The step's MoE metrics, accumulated on the device without host syncs over two forwards
    (padded, then packed; the expert bias flipped so that trainer and generator disagree), equal
    the plain computation's."""
    model, prompts, completions = rollout
    batch = _batch(prompts, completions)
    monitor = MoEMonitor(model)
    saved = [m.expert_bias.clone() for m in model.moe_layers()]
    total = 0
    try:
        for moe in model.moe_layers():
            moe.expert_bias.mul_(-1.0)
        for packing in ("off", "on"):
            with torch.no_grad():
                forward_logprobs(model, batch, True, 64, packing=packing)
            monitor.observe(model, batch, packing)
            total = total + _reference_sums(monitor, model, batch, packing)
    finally:
        for moe, bias in zip(model.moe_layers(), saved):
            moe.expert_bias.copy_(bias)
    decisions, disagree, entropy, aux, forwards = total[:5].tolist()
    load_L = [(row.max() / row.mean()).item() for row in total[5:].view(2, -1)]
    expected = {
        "moe_route_disagree": disagree / decisions,
        "moe_router_entropy": entropy / decisions,
        "moe_aux_loss": aux / forwards,
        "moe_load_max_mean": sum(load_L) / 2,
        "moe_load_max_mean_l0": load_L[0],
        "moe_load_max_mean_l1": load_L[1],
    }
    got = monitor.metrics(None)
    assert got == pytest.approx(expected, rel=1e-12, abs=0) and disagree > 0
    assert monitor.metrics(None)["moe_route_disagree"] == 0.0  # reset: an empty step


def _statistics(model, batch, packing, replay) -> tuple[float, torch.Tensor]:
    """(aux loss, expert loads [MoE layers, E]) of one batch-invariant forward."""
    for moe in model.moe_layers():
        moe.tokens_per_expert.zero_()
    with torch.no_grad():
        forward_logprobs(model, batch, True, 64, packing=packing, replay_routes=replay)
    return model.moe_aux_loss().item(), torch.stack([m.tokens_per_expert.clone() for m in model.moe_layers()])


@pytest.mark.parametrize("packing", ["off", "on"])
def test_padding_is_left_out_of_aux_loss_and_loads_with_and_without_replay(rollout, packing):
    """A padded batch of samples of unequal lengths (packed rows end in padding too), whose
    recorded routes are the trainer's own (batch-invariant): the auxiliary loss and the expert
    loads are the same with replay and without, count exactly the real tokens (k slots each),
    and do not move when the padding tokens change."""
    model, prompts, completions = rollout
    batch = _batch(prompts, completions)
    real = int((batch["routes"][..., 0, 0] >= 0).sum())
    assert real < batch["routes"].shape[0] * batch["routes"].shape[1]  # there is padding
    on, off = (_statistics(model, batch, packing, replay) for replay in (True, False))
    assert on[0] == off[0] and torch.equal(on[1], off[1])
    assert (on[1].sum(-1) == real * ARGS.moe_top_k).all()
    padding = batch["routes"][..., 0, 0] < 0
    repadded = batch.clone()
    repadded["tokens"][:, :-1][padding] = 7  # other padding ids: other router choices there
    for replay in (True, False):
        aux, loads = _statistics(model, repadded, packing, replay)
        assert aux == pytest.approx(on[0], rel=1e-6) and torch.equal(loads, on[1])


def test_moe_run_with_replay_logs_the_metrics(tmp_path):
    config = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
    small = ["--training.steps=2", "--sft_warmup.steps=2", "--sft_warmup.batch_size=8", "--training.batch_size=4"]
    small += ["--algorithm.group_size=4", "--generator.max_new_tokens=6", "--data.num_eval_samples=8"]
    small += ["--reward.num_workers=1", "--metrics.eval_freq=0", "--model.flavor=debug-moe"]
    extra = ["--generator.batch_invariant=true", "--moe.routing_replay=rollout", f"--job.dump_folder={tmp_path}"]
    train.main([f"--job.config_file={config}", *small, *extra])
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "reward_mean" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["moe_route_disagree"] == 0.0 and m["mismatch_kl"] == 0.0 and m["gen_logprob_diff"] == 0.0
        assert 0.0 < m["moe_router_entropy"] <= torch.log(torch.tensor(8.0)).item() + 1e-6
        assert m["moe_aux_loss"] > 0 and 1.0 <= m["moe_load_max_mean"] <= 8.0
        assert all(f"moe_load_max_mean_l{i}" in m for i in range(3))


def test_lora_float8_and_quantised_rollout_on_moe_work_or_fail_at_load():
    with torch.device("meta"):
        model = Transformer(ARGS)
    assert add_lora(model, LoRA(enable=True, target_modules=["wq", "wv"])) == 2 * ARGS.n_layers
    with torch.device("meta"):
        model = Transformer(ARGS)
    with pytest.raises(ValueError, match=r"\[lora\] target_modules .*'w1'.* mixture of experts"):
        add_lora(model, LoRA(enable=True, target_modules=["wq", "w1"]))
    with pytest.raises(ValueError, match=r"\[float8\] does not support mixture-of-experts"):
        convert_to_float8(model, Float8(enable=True))
    with pytest.raises(ValueError, match=r"\[generator\] quantize = 'int8' is not supported for mixture-of-experts"):
        Generator(ARGS, GeneratorConfig(block_size=4, num_blocks=16, quantize="int8"), CPU)
