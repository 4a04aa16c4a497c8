"""The RL update loop never waits for the device per micro-batch: its statistics accumulate on
the device and reach the host once per step (`StepStats.flush`). On a GPU every `.item()`,
`.tolist()` or `.cpu()` of a device tensor is such a wait; counted here on the CPU, where the
calls are the same."""

import dataclasses
import os

import pytest
import torch
from helpers.launch import REPO_ROOT

from titanrl.components.step_stats import StepStats, maximum
from titanrl.config import load_config
from titanrl.recipes import rl_recipe as rl
from titanrl.train import build_trainer

CONFIGS = os.path.join(REPO_ROOT, "train_configs")
HOST_COPIES = ("item", "tolist", "cpu")


def _update_syncs(tmp_path, monkeypatch, micro_batch_tokens: int) -> tuple[int, int, dict]:
    """(host copies inside the policy and critic updates of one PPO step, micro-batches trained
    on, the step's metrics); `micro_batch_tokens` = 0 is one micro-batch per mini-batch."""
    trainer = build_trainer(
        load_config(
            [
                f"--job.config_file={CONFIGS}/ppo_reverse_debug.toml",
                f"--job.dump_folder={tmp_path}",
                "--sft_warmup.steps=0",
                "--training.batch_size=4",
                "--algorithm.group_size=4",
                "--algorithm.kl_coef=0.01",  # a reference: the KL statistic too
                "--algorithm.off_policy_correction=tis",
                "--critic.warmup_steps=0",
                "--generator.max_new_tokens=6",
                "--data.num_eval_samples=4",
                "--reward.num_workers=1",
                "--metrics.eval_freq=0",
                f"--training.micro_batch_tokens={micro_batch_tokens}",
            ]
        )
    )
    counts = {"copies": 0, "backward": 0, "counting": False}
    for name in HOST_COPIES:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            counts["copies"] += counts["counting"]
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def counting(fn, on: bool):
        def run(*args, **kwargs):
            before, counts["counting"] = counts["counting"], on
            try:
                return fn(*args, **kwargs)
            finally:
                counts["counting"] = before

        return run

    recipe, backward = trainer.recipe, trainer.backward
    monkeypatch.setattr(recipe, "update_policy", counting(recipe.update_policy, True))
    monkeypatch.setattr(recipe, "update_critic", counting(recipe.update_critic, True))
    # Not counted: micro-batch planning works on a python list of lengths (host tensors only); the
    # forwards read the micro-batch's lengths to lay its rows out (data.packing, a shape the
    # host needs); torch's optimizers keep their step counters on the host.
    for name in ("use_packing", "forward_logprobs", "forward_values"):
        monkeypatch.setattr(rl, name, counting(getattr(rl, name), False))
    monkeypatch.setattr(trainer, "plan_micro_batches", counting(trainer.plan_micro_batches, False))
    for optimizer in (trainer.optimizer, recipe.critic_optimizer):
        monkeypatch.setattr(optimizer, "step", counting(optimizer.step, False))

    def counted_backward(loss, step):
        counts["backward"] += 1
        return backward(loss, step)

    monkeypatch.setattr(trainer, "backward", counted_backward)
    try:
        metrics = recipe.step(iter(recipe.loader), 1)
    finally:
        monkeypatch.undo()
        trainer.close()
    return counts["copies"], counts["backward"], metrics


def test_update_loop_host_copies_do_not_grow_with_micro_batches(tmp_path, monkeypatch):
    one, one_mb, whole = _update_syncs(tmp_path / "one", monkeypatch, 0)
    many, many_mb, split = _update_syncs(tmp_path / "many", monkeypatch, 24)
    # 2 mini-batches x (policy + critic update) = 4 updates; each reads its global token count
    # (the policy's its sequence count too), its lengths and its grad norm: 2 x (4 + 3) = 14,
    # however many micro-batches.
    assert one_mb == 4 and many_mb >= 12, (one_mb, many_mb)
    assert many == one <= 14, (one, many)
    # Every micro-batch's sums arrive (rounding differs with the split; a lost one would be >= 25 %).
    for key in ("kl", "entropy", "gen_logprob_diff", "value_loss"):
        assert whole[key] == pytest.approx(split[key], rel=1e-2, abs=1e-6), key


@dataclasses.dataclass
class _Stats(StepStats):
    total: float = 0.0
    peak: float = maximum(0.0)


def test_device_sums_equal_python_float_sums_bit_for_bit():
    """`add_on_device` / `max_on_device` then `flush` give the floats that adding `.item()`s in
    python gives (float64 both, the same additions in the same order); NaNs are ignored by the
    maximum as python's max(field, nan) ignores them."""
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(100, generator=g).exp().sum() for _ in range(50)]  # float32 sums
    peaks = [torch.tensor(float("nan"))] + [v / 7 for v in values] + [torch.tensor(float("nan"))]
    stats, want_total, want_peak = _Stats(), 0.0, 0.0
    for v in values:
        stats.add_on_device(total=v)
        want_total += v.item()
    for p in peaks:
        stats.max_on_device(peak=p)
        want_peak = max(want_peak, p.item())
    stats.flush()
    assert (stats.total, stats.peak) == (want_total, want_peak)
    assert stats.total != float(torch.stack(values).sum())  # float32 sums would differ
