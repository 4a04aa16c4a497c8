import pytest
import torch

from titanrl.components.optimizer import build_lr_scheduler, build_optimizer, lr_factor
from titanrl.config.training import LRScheduler, Optimizer


def test_lr_schedule_values():
    cfg = LRScheduler(warmup_steps=2, decay_type="linear", min_lr_factor=0.1)
    # warm-up 1/3, 2/3, then peak, then linear to 0.1 at the last step (step 6 of 7).
    got = [lr_factor(s, 7, cfg) for s in range(7)]
    assert got == pytest.approx([1 / 3, 2 / 3, 1.0, 0.775, 0.55, 0.325, 0.1])
    cos = LRScheduler(decay_type="cosine", min_lr_factor=0.0)
    assert [lr_factor(s, 3, cos) for s in range(3)] == pytest.approx([1.0, 0.5, 0.0])
    assert lr_factor(5, 3, LRScheduler()) == 1.0


def test_optimizer_and_scheduler_drive_lr():
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer(model, Optimizer(lr=0.3, weight_decay=0.01, beta2=0.99))
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.9, 0.99)
    sched = build_lr_scheduler(opt, 4, LRScheduler(warmup_steps=1, decay_type="linear"))
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.15, 0.3, 0.15, 0.0])
    assert isinstance(build_optimizer(model, Optimizer(name="SGD", lr=0.1)), torch.optim.SGD)
