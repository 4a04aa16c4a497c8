"""On-policy distillation (`titanrl/rl/distillation.py`): the reverse-KL advantage and its
mixing with task advantages against plain float64 loops, the chunked generalised JSD against a
float64 reference (value, gradient, its beta limits, peak memory at a 151,936-token vocabulary),
the teacher's checks, and short RL runs with a teacher HF folder."""

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers.launch import REPO_ROOT, run_cmd, train_cmd
from helpers.tiny import smoke_run_args, tiny_model
from tensordict import TensorDict

from titanrl.algorithms import ALGORITHMS, LossInputs
from titanrl.config import load_config
from titanrl.models import TransformerModelArgs
from titanrl.models.hf import export_hf
from titanrl.rl import distillation
from titanrl.rl.distillation import (
    Distiller,
    DistillStats,
    build_teacher,
    check_distillation,
    chunked_jsd,
    distillation_advantages,
    mix_advantages,
)

CONFIG = os.path.join(REPO_ROOT, "train_configs", "distill_reverse_debug.toml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT}
TOL = 1e-6  # float32 sums of a few terms of magnitude <= 10 vs float64 loops


def _loop_mixed_advantages(student, teacher, mask, task, coef, task_coef):
    """A_t = task_coef * A_task + coef * -(log pi_s - log pi_T), 0 off the mask, in float64 loops."""
    out = []
    for b in range(len(student)):
        row = []
        for t in range(len(student[b])):
            a_task = task[b] if isinstance(task[b], float) else task[b][t]
            a = task_coef * a_task + coef * -(student[b][t] - teacher[b][t])
            row.append(a if mask[b][t] else 0.0)
        out.append(row)
    return out


@pytest.mark.parametrize("per_token_task", [False, True])
def test_reverse_kl_advantage_and_mixing_match_float64_loops(per_token_task):
    g = torch.Generator().manual_seed(0)
    B, T = 5, 7
    student, teacher = -3 * torch.rand(B, T, generator=g), -3 * torch.rand(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[2] = 0.0  # a row with no completion token
    task = torch.randn(B, T, generator=g) if per_token_task else torch.randn(B, generator=g)
    distill = distillation_advantages(student, teacher, mask)
    got = mix_advantages(task, distill, mask, coef=0.7, task_reward_coef=0.3)
    want = _loop_mixed_advantages(
        student.double().tolist(), teacher.double().tolist(), mask.tolist(), task.double().tolist(), 0.7, 0.3
    )
    assert got.shape == (B, T)
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=0, atol=TOL)
    # Pure distillation (the recipe's default): the task term is gone, the sign favours the teacher's tokens.
    pure = mix_advantages(task, distill, mask, coef=1.0, task_reward_coef=0.0)
    torch.testing.assert_close(pure, (teacher - student) * mask)


def _batch(student_lp, teacher_lp, mask, old=None):
    B, T = mask.shape
    fields = {
        "tokens": torch.zeros(B, T + 1, dtype=torch.long),
        "loss_mask": mask,
        "gen_logprobs": student_lp,
        "teacher_logprobs": teacher_lp,
        "length": torch.full((B,), T + 1),
    }
    if old is not None:
        fields["old_logprobs"] = old
    return TensorDict(fields, batch_size=[B])


def test_distiller_advantages_use_the_trainers_logprobs_when_present_and_count_statistics():
    config = load_config(
        [f"--job.config_file={CONFIG}", "--distillation.task_reward_coef=0.5", "--distillation.coef=2"]
    )
    distiller = Distiller(config, teacher=None)
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    gen, teacher, old = torch.full((2, 3), -1.0), torch.full((2, 3), -0.25), torch.full((2, 3), -2.0)
    stats = DistillStats()
    adv = distiller.advantages(torch.tensor([1.0, -1.0]), _batch(gen, teacher, mask), stats)
    # 0.5 * A_task + 2 * (-(-1 + 0.25)) = 0.5 * A_task + 1.5
    torch.testing.assert_close(adv, torch.tensor([[0.0, 2.0, 2.0], [1.0, 1.0, 0.0]]))
    assert stats.distill_metrics() == pytest.approx({"distill_reverse_kl": -0.75, "teacher_logprob": -0.25})
    adv_old = distiller.advantages(torch.tensor([1.0, -1.0]), _batch(gen, teacher, mask, old), DistillStats())
    torch.testing.assert_close(adv_old, torch.tensor([[0.0, 4.0, 4.0], [3.0, 3.0, 0.0]]))


# ---- generalised JSD ----


def _loop_jsd(logits_s, logits_t, beta):
    """JSD_beta(p_T || p_s) per row, m = beta p_T + (1 - beta) p_s, in float64 Python loops."""
    out = []
    for zs, zt in zip(logits_s, logits_t):
        ls, lt = math.log(sum(math.exp(z) for z in zs)), math.log(sum(math.exp(z) for z in zt))
        ps, pt = [math.exp(z - ls) for z in zs], [math.exp(z - lt) for z in zt]
        m = [beta * a + (1 - beta) * b for a, b in zip(pt, ps)]
        kl_t = sum(a * math.log(a / c) for a, c in zip(pt, m))
        kl_s = sum(b * math.log(b / c) for b, c in zip(ps, m))
        out.append(beta * kl_t + (1 - beta) * kl_s)
    return out


def _loop_kl(logits_p, logits_q):
    """KL(p || q) per row in float64 loops."""
    out = []
    for zp, zq in zip(logits_p, logits_q):
        lp, lq = math.log(sum(math.exp(z) for z in zp)), math.log(sum(math.exp(z) for z in zq))
        out.append(sum(math.exp(a - lp) * ((a - lp) - (b - lq)) for a, b in zip(zp, zq)))
    return out


def _jsd_inputs(N=9, D=6, E=10, V=13, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(N, D, generator=g, dtype=dtype),
        torch.randn(V, D, generator=g, dtype=dtype),
        torch.randn(N, E, generator=g, dtype=dtype),
        torch.randn(V, E, generator=g, dtype=dtype),
    )


@pytest.mark.parametrize("chunk", [1, 4, 100])
@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_chunked_jsd_matches_float64_loops(beta, chunk):
    h_s, w_s, h_t, w_t = _jsd_inputs()
    got = chunked_jsd(h_s, w_s, h_t, w_t, beta, chunk)
    want = _loop_jsd((h_s @ w_s.T).tolist(), (h_t @ w_t.T).tolist(), beta)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert (got >= 0).all()


@pytest.mark.parametrize("beta", [0.2, 0.7])
def test_chunked_jsd_gradient_matches_finite_differences(beta):
    """The analytic backward (recomputed chunk logits) against float64 central differences."""
    h_s, w_s, h_t, w_t = _jsd_inputs(N=5, D=3, E=4, V=7)
    h_s.requires_grad_(True)
    w_s.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_jsd(h, w, h_t, w_t, beta, 2), (h_s, w_s), eps=1e-6, atol=1e-7, rtol=1e-5
    )


def test_chunked_jsd_limits_are_forward_and_reverse_kl():
    """JSD_beta / beta -> KL(p_T || p_s) as beta -> 0; JSD_beta / (1 - beta) -> KL(p_s || p_T) as beta -> 1."""
    h_s, w_s, h_t, w_t = _jsd_inputs()
    w_s, w_t = 0.3 * w_s, 0.3 * w_t  # logits of std ~0.7: probability ratios within ~e^4
    logits_s, logits_t = (h_s @ w_s.T).tolist(), (h_t @ w_t.T).tolist()
    # The next order is O(beta * E_T[p_T / p_s]) (resp. (1 - beta) E_s[p_s / p_T]): ~1e-6 relative at
    # beta = 1e-8; float64 cancellation in the vanishing KL(. || m) term stays ~1e-8.
    eps = 1e-8
    forward = chunked_jsd(h_s, w_s, h_t, w_t, eps, 4) / eps
    reverse = chunked_jsd(h_s, w_s, h_t, w_t, 1 - eps, 4) / eps
    torch.testing.assert_close(
        forward, torch.tensor(_loop_kl(logits_t, logits_s), dtype=torch.float64), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(
        reverse, torch.tensor(_loop_kl(logits_s, logits_t), dtype=torch.float64), rtol=1e-5, atol=0
    )


MEMORY_SCRIPT = r"""
import json, resource, sys, torch
from titanrl.rl.distillation import chunked_jsd
N, D, V, chunk = 256, 16, 151_936, 8
g = torch.Generator().manual_seed(0)
h_s = torch.randn(N, D, generator=g).requires_grad_(True)
w_s = (0.1 * torch.randn(V, D, generator=g)).requires_grad_(True)
h_t, w_t = torch.randn(N, 24, generator=g), 0.1 * torch.randn(V, 24, generator=g)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
jsd = chunked_jsd(h_s, w_s, h_t, w_t, 0.5, chunk)
jsd.sum().backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_delta_mb": (peak - before) / 1024, "full_logits_mb": N * V * 4 / 2**20,
                  "chunk_logits_mb": chunk * V * 4 / 2**20, "finite": bool(torch.isfinite(jsd).all()
                  and torch.isfinite(w_s.grad).all())}))
"""


def test_chunked_jsd_memory_at_real_vocabulary():
    """Forward + backward over 256 positions at 151,936 tokens, 8 positions of logits at a time, in
    a fresh process: the peak RSS rise stays far below one [256, 151936] float32 logits tensor
    (148 MB; a full-vocabulary JSD with autograd would hold several): grad W (9 MB), a handful of
    [8, 151936] buffers (4.6 MB each) and the first call's kernel set-up: ~35 MB measured."""
    # Every allocation over 128 kB its own mapping, returned on free: without it glibc's heap keeps
    # freed chunk buffers (its mmap threshold grows with them) and RSS measures fragmentation.
    env = {**ENV, "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT], env=env, capture_output=True, text=True, cwd=REPO_ROOT, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)
    assert result["finite"]
    assert result["peak_delta_mb"] < 0.5 * result["full_logits_mb"], result


# ---- the teacher's checks ----


def _write_hf(folder, vocab_size=264, dim=64, n_layers=2, seed=0):
    args = TransformerModelArgs(
        family="qwen3",
        dim=dim,
        n_layers=n_layers,
        n_heads=2,
        n_kv_heads=1,
        hidden_dim=2 * dim,
        vocab_size=vocab_size,
        qk_norm=True,
        tie_word_embeddings=True,
        max_seq_len=128,
    )
    model = tiny_model(args, seed)
    export_hf(model, str(folder))
    return str(folder)


def _trainer_stub(config, world_size=1):
    return SimpleNamespace(
        config=config,
        model_args=TransformerModelArgs(vocab_size=264, max_seq_len=256),
        dims=SimpleNamespace(world_size=world_size),
        model=torch.nn.Linear(1, 1),
        device=torch.device("cpu"),
    )


def test_teacher_with_another_vocabulary_is_rejected(tmp_path, monkeypatch):
    small = _write_hf(tmp_path / "small", vocab_size=200)
    config = load_config([f"--job.config_file={CONFIG}", f"--distillation.teacher_hf_checkpoint={small}"])
    with pytest.raises(ValueError, match=r"vocab_size 200, the student 264.*share the student's tokenizer"):
        build_teacher(small, _trainer_stub(config))
    # A padded, larger vocabulary (as Qwen2.5-7B's for a 0.5B student): fine for sampled-token
    # logprobs, not for the full-vocabulary JSD.
    padded = _write_hf(tmp_path / "padded", vocab_size=300)
    built = []
    monkeypatch.setattr(distillation, "build_model", lambda args, *a, **k: built.append(args) or torch.nn.Linear(1, 1))
    build_teacher(padded, _trainer_stub(config))
    assert built[0].vocab_size == 300
    jsd = load_config(
        [
            f"--job.config_file={CONFIG}",
            f"--distillation.teacher_hf_checkpoint={padded}",
            "--distillation.divergence=jsd",
        ]
    )
    with pytest.raises(ValueError, match=r"vocab_size 300, the student 264.*divergence = 'reverse_kl'"):
        build_teacher(padded, _trainer_stub(jsd))


def test_only_algorithms_whose_loss_takes_per_token_advantages_are_accepted():
    config = load_config([f"--job.config_file={CONFIG}"])
    B, T = 3, 4
    for _name, cls in ALGORITHMS.items():
        algorithm = cls(config.algorithm)
        if cls.token_advantages:
            check_distillation(config, algorithm, _trainer_stub(config))
            lp = torch.randn(B, T)
            out = algorithm.loss(
                LossInputs(
                    lp,
                    lp,
                    torch.randn(B, T),
                    torch.ones(B, T),
                    num_global_tokens=B * T,
                    num_global_seqs=B,
                    ref_logprobs_BT=lp,
                )
            )
            assert torch.isfinite(out.loss)
        else:
            with pytest.raises(ValueError, match="per-token advantages"):
                check_distillation(config, algorithm, _trainer_stub(config))
    assert not ALGORITHMS["gspo"].token_advantages  # GSPO, one ratio per sequence, is rejected
    assert {"grpo", "cispo", "sapo", "ppo"} <= {name for name, cls in ALGORITHMS.items() if cls.token_advantages}
    jsd = load_config([f"--job.config_file={CONFIG}", "--distillation.divergence=jsd"])
    with pytest.raises(ValueError, match="divergence = 'jsd'.*1 rank"):
        check_distillation(jsd, ALGORITHMS["grpo"](jsd.algorithm), _trainer_stub(jsd, world_size=2))


# ---- short RL runs with a teacher ----

SMALL = smoke_run_args(
    "--checkpoint.enable=false",
    "--generator.num_blocks=256",
    config=None,
    steps=2,
    sft_steps=None,
    max_new_tokens=None,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A small student and a larger teacher (its own shape) as HF folders, byte vocabulary."""
    root = tmp_path_factory.mktemp("distill_models")
    return _write_hf(root / "student", dim=32, n_layers=1, seed=1), _write_hf(root / "teacher", dim=64, n_layers=2)


def _steps(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if m.get("phase") == "rl" and "distill_reverse_kl" in m]


def test_rl_run_with_a_teacher_logs_finite_distillation_metrics(models, tmp_path):
    student, teacher = models
    args = [
        f"--job.config_file={CONFIG}",
        f"--job.dump_folder={tmp_path}",
        f"--model.hf_checkpoint={student}",
        f"--distillation.teacher_hf_checkpoint={teacher}",
        "--distillation.task_reward_coef=1.0",
        *SMALL,
    ]
    proc = run_cmd(train_cmd(args), ENV, timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = _steps(tmp_path)
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        for key in ("distill_reverse_kl", "teacher_logprob", "grad_norm", "entropy", "reward_mean"):
            assert math.isfinite(m[key]), (key, m)
        # Two random models over 264 tokens: the teacher's logprob of the student's samples is near
        # log(1/264) = -5.58, and the k1 estimate of KL(pi_s || pi_T) is small but not 0.
        assert -8.0 < m["teacher_logprob"] < -4.0 and m["distill_reverse_kl"] != 0.0
        assert "distill_jsd" not in m


def test_rl_run_with_the_jsd_loss(models, tmp_path):
    student, teacher = models
    args = [
        f"--job.config_file={CONFIG}",
        f"--job.dump_folder={tmp_path}",
        f"--model.hf_checkpoint={student}",
        f"--distillation.teacher_hf_checkpoint={teacher}",
        "--distillation.divergence=jsd",
        "--training.packing=on",
        *SMALL,
    ]
    proc = run_cmd(train_cmd(args), ENV, timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = _steps(tmp_path)
    assert len(steps) == 2
    for m in steps:
        assert 0.0 < m["distill_jsd"] < math.log(2) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
