"""LoRA (titanrl/models/lora.py): the adapted projection against a float64 reference, a frozen
base (optimizer and checkpoint hold adapters only; their size measured), the reference policy as
adapters-off, merged and PEFT exports reloaded in `transformers` + `peft`, and GRPO with LoRA on 2
FSDP2 ranks and on tp=2 matching one rank."""

import json
import math
import os

import pytest
import torch
from helpers import background
from helpers.launch import REPO_ROOT
from helpers.tiny import smoke_run_args, tiny_model, tiny_qwen2_args
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from titanrl import train
from titanrl.components.model_builder import build_model, init_full_state_dict
from titanrl.components.optimizer import build_optimizer
from titanrl.config import JobConfig, load_config
from titanrl.config.model import LoRA as LoRAConfig
from titanrl.distributed.parallel_dims import ParallelDims
from titanrl.models.flavors import get_model_args
from titanrl.models.hf import export_hf, export_peft_adapter, to_hf_state_dict
from titanrl.models.lora import (
    AdaptersOff,
    LoRALinear,
    adapters_disabled,
    add_lora,
    freeze_base,
    init_lora,
    merge_lora_state_dict,
    resolve_targets,
)
from titanrl.models.model import Transformer

ARGS = tiny_qwen2_args(vocab_size=97, max_seq_len=64)
ALL = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]


def _lora_model(args=ARGS, targets=ALL, rank=4, alpha=8.0, seed=0, dtype=torch.float32) -> Transformer:
    """A plain 1-rank model with adapters whose B is random (non-zero), so they change the output."""
    model = tiny_model(args, seed)
    add_lora(model, LoRAConfig(enable=True, rank=rank, alpha=alpha, target_modules=targets))
    init_lora(model, seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.weight.normal_(0.0, 0.05)
    return model.to(dtype)


def test_adapted_projection_matches_float64_reference():
    torch.manual_seed(0)
    base = torch.nn.Linear(12, 10, bias=True)
    lora = LoRALinear.from_linear(base, rank=3, alpha=6.0, dropout=0.0)
    with torch.no_grad():
        lora.lora_a.weight.normal_()
        lora.lora_b.weight.normal_()
    x = torch.randn(5, 12)
    W, b, A, B = (t.detach().double() for t in (base.weight, base.bias, lora.lora_a.weight, lora.lora_b.weight))
    want = x.double() @ W.T + b + (6.0 / 3) * (x.double() @ A.T @ B.T)
    torch.testing.assert_close(lora(x).double(), want, atol=1e-5, rtol=1e-5)
    assert lora.weight is base.weight  # the base parameter is shared, not copied
    with adapters_disabled(lora):
        torch.testing.assert_close(lora(x), base(x), atol=0, rtol=0)
    assert lora.adapters_enabled


def test_fresh_adapters_leave_the_base_unchanged_and_only_they_train():
    config = JobConfig()
    config.lora = LoRAConfig(enable=True, rank=4, target_modules=["q_proj", "v_proj", "w2"])
    plain = build_model(ARGS, ParallelDims(1, 1, 1, 1), config, torch.device("cpu"))
    adapted = build_model(ARGS, ParallelDims(1, 1, 1, 1), config, torch.device("cpu"), lora=config.lora)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 9))
    torch.testing.assert_close(adapted(tokens), plain(tokens), atol=0, rtol=0)  # B = 0 at start
    trainable = sorted(n for n, p in adapted.named_parameters() if p.requires_grad)
    assert trainable == sorted(
        f"layers.{i}.{m}.{ab}.weight"
        for i in range(2)
        for m in ("attention.wq", "attention.wv", "feed_forward.w2")
        for ab in ("lora_a", "lora_b")
    )
    # A is initialised (Kaiming-uniform bound 1/sqrt(in)), identically for one seed.
    a = adapted.layers["0"].attention.wq.lora_a.weight
    assert 0 < a.abs().max() <= 1 / math.sqrt(ARGS.dim)
    again = build_model(ARGS, ParallelDims(1, 1, 1, 1), config, torch.device("cpu"), lora=config.lora)
    assert torch.equal(again.layers["0"].attention.wq.lora_a.weight, a)


def test_unknown_target_is_a_clear_error():
    assert resolve_targets(["q_proj", "wq", "down_proj"]) == ["wq", "w2"]
    with pytest.raises(ValueError, match="unknown target module 'qkv'.*q_proj"):
        resolve_targets(["qkv"])


def test_optimizer_state_scales_with_adapter_size():
    """AdamW keeps two moments per trainable element: with a frozen base they are the adapters'."""
    config = JobConfig()
    sizes = {}
    for rank in (2, 8, 32):
        config.lora = LoRAConfig(enable=True, rank=rank, target_modules=ALL)
        model = build_model(ARGS, ParallelDims(1, 1, 1, 1), config, torch.device("cpu"), lora=config.lora)
        sizes[rank] = (_adam_state_bytes(model, config), sum(p.numel() for p in model.parameters() if p.requires_grad))
    full = build_model(ARGS, ParallelDims(1, 1, 1, 1), config, torch.device("cpu"))
    full_bytes, full_params = _adam_state_bytes(full, config), sum(p.numel() for p in full.parameters())
    for rank, (state_bytes, adapter_params) in sizes.items():
        assert state_bytes == 2 * 4 * adapter_params  # exp_avg + exp_avg_sq in fp32 (step is a scalar)
        assert adapter_params == rank * sum(out + inp for out, inp in _target_shapes())  # A [r, in] + B [out, r]
    assert full_bytes == 2 * 4 * full_params
    assert sizes[8][0] / full_bytes < 0.3 and sizes[32][0] / sizes[8][0] == pytest.approx(4.0)


def _target_shapes() -> list[tuple[int, int]]:
    a = ARGS
    q, kv = a.n_heads * (a.dim // a.n_heads), a.n_kv_heads * (a.dim // a.n_heads)
    per_layer = [
        (q, a.dim),
        (kv, a.dim),
        (kv, a.dim),
        (a.dim, q),
        (a.hidden_dim, a.dim),
        (a.dim, a.hidden_dim),
        (a.hidden_dim, a.dim),
    ]
    return per_layer * a.n_layers


def _adam_state_bytes(model, config) -> int:
    opt = build_optimizer(model, config.optimizer)
    loss = model(torch.randint(0, ARGS.vocab_size, (2, 8))).float().pow(2).mean()
    loss.backward()
    opt.step()
    return sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")


def test_reference_of_a_lora_policy_is_its_base():
    model = _lora_model()
    base = Transformer(ARGS)
    base.load_state_dict({k: v for k, v in model.state_dict().items() if ".lora_" not in k})
    tokens = torch.randint(0, ARGS.vocab_size, (2, 10))
    with torch.no_grad():
        got, _ = AdaptersOff(model).logprobs(tokens[:, :-1], tokens[:, 1:], 64)
        want, _ = base.logprobs(tokens[:, :-1], tokens[:, 1:], 64)
        adapted, _ = model.logprobs(tokens[:, :-1], tokens[:, 1:], 64)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert (adapted - want).abs().max() > 1e-3
    assert all(m.adapters_enabled for m in model.modules() if isinstance(m, LoRALinear))


def test_merged_state_dict_gives_the_adapted_model(tmp_path):
    model = _lora_model()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 11))
    plain = Transformer(ARGS)
    plain.load_state_dict(merge_lora_state_dict(model.state_dict(), model))
    torch.testing.assert_close(plain(tokens), model(tokens), atol=1e-5, rtol=0)
    assert (plain(tokens) - _base_logits(model, tokens)).abs().max() > 1e-3  # the adapters mattered


def _base_logits(model, tokens):
    with adapters_disabled(model), torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("mode", ["runtime", "merged"])
def test_generator_serves_base_plus_adapter(mode):
    """Runtime adapters (synced as tensors) or merged weights (W + s B A at each sync): the
    generator's logprobs are the trainer's, before and after the adapters change."""
    from titanrl.config.generation import Generator as GeneratorConfig
    from titanrl.generator import Generator, SamplingParams

    trainer = _lora_model(targets=["wq", "wo", "w1", "w2"])
    lora = LoRAConfig(enable=True, rank=4, alpha=8.0, target_modules=["wq", "wo", "w1", "w2"], generator=mode)
    gen = Generator(
        ARGS,
        GeneratorConfig(num_blocks=64, block_size=8),
        torch.device("cpu"),
        lora=lora if mode == "runtime" else None,
    )
    assert gen.share_weights(trainer) == (mode == "runtime")  # merged weights are the generator's own
    prompts = [[1, 5, 9, 2], [3, 3, 7]]
    for change in range(2):
        if change:
            with torch.no_grad():
                for module in trainer.modules():
                    if isinstance(module, LoRALinear):
                        module.lora_a.weight.add_(0.1)
        gen.load_weights(trainer)
        completions, _ = gen.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=3))
        for i, c in enumerate(completions):
            tokens = torch.tensor([prompts[i // 2] + c.token_ids])
            with torch.no_grad():
                want = torch.log_softmax(trainer(tokens[:, :-1]).double(), -1)[0, len(prompts[i // 2]) - 1 :]
            want = want.gather(-1, tokens[0, len(prompts[i // 2]) :, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), want, atol=1e-5, rtol=0)


def test_peft_export_reloads_in_peft_and_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model = _lora_model(targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    with adapters_disabled(model):
        export_hf(model, str(tmp_path / "base"), merge_lora=False)
    export_peft_adapter(
        model, str(tmp_path / "adapter"), rank=4, alpha=8.0, dropout=0.0, base_model=str(tmp_path / "base")
    )
    export_hf(model, str(tmp_path / "merged"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert set(config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    keys = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys and len(keys) == 2 * 7 * 2

    tokens = torch.randint(0, ARGS.vocab_size, (2, 13))
    with torch.no_grad():
        want = model(tokens)
        hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
        peft_model = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "adapter")).eval()
        got = peft_model(tokens).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
        got_merged = merged(tokens).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert (got_merged - want).abs().max().item() <= 1e-5
    assert (got - _base_logits(model, tokens)).abs().max() > 1e-3  # peft really applied the adapters


# ---- GRPO with LoRA: 1 rank, 2 FSDP2 ranks, tp=2 ----

CONFIG = os.path.join(REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
SMALL = smoke_run_args(
    "--checkpoint.export_hf=true",
    "--lora.enable=true",
    "--lora.rank=4",
    "--lora.target_modules=wq,wv,wo,w2",
    "--algorithm.kl_coef=0.05",
)


def _metrics(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if m.get("phase") == "rl" and "reward_mean" in m]


CHECKPOINTS = ["--checkpoint.enable=true", "--checkpoint.interval=2", "--checkpoint.keep_latest_k=5"]


@pytest.fixture(scope="module")
def one_rank_lora(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora1")
    train.main([*SMALL, *CHECKPOINTS, f"--job.dump_folder={folder}"])
    return folder


def test_lora_run_trains_adapters_only_and_exports(one_rank_lora):
    steps = _metrics(one_rank_lora)
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert all(m["grad_norm"] > 0 and math.isfinite(m["entropy"]) for m in steps)
    # The reference is the base model (adapters off), which the warm-up's adapters already left.
    assert all(m["kl"] > 0 for m in steps)
    base = load_file(os.path.join(one_rank_lora, "hf_base", "model.safetensors"))
    merged = load_file(os.path.join(one_rank_lora, "hf", "model.safetensors"))
    adapters = load_file(os.path.join(one_rank_lora, "peft_adapter", "adapter_model.safetensors"))
    assert len(adapters) == 4 * 4 * 2  # layers x targets x (A, B)
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.split(".")[-2] in ("q_proj", "v_proj", "o_proj", "down_proj") for k in changed)
    # The base never trained: it is still the seeded initialisation, bit for bit.
    config = load_config([f"--job.config_file={CONFIG}"])
    init = to_hf_state_dict(
        init_full_state_dict(get_model_args(config.model.flavor), config.job.seed), get_model_args(config.model.flavor)
    )
    assert base.keys() == init.keys() and all(torch.equal(base[k], init[k]) for k in base)


def test_lora_checkpoint_holds_adapters_only_and_resumes_exactly(one_rank_lora, tmp_path):
    step2 = os.path.join(one_rank_lora, "checkpoint", "step-2")
    keys = FileSystemReader(step2).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:5]
    assert not any(k.startswith("reference.") for k in keys)  # the reference is the base: nothing to save
    # Resume from step-2 in a fresh folder: step 3 and the final adapters are the same bit for bit.
    train.main(
        [
            *SMALL,
            *CHECKPOINTS,
            f"--job.dump_folder={tmp_path}",
            f"--checkpoint.load_path={step2}",
        ]
    )
    got, want = _metrics(tmp_path)[-1], _metrics(one_rank_lora)[-1]
    assert got["step"] == want["step"] == 3
    assert {k: got[k] for k in ("reward_mean", "grad_norm", "kl", "entropy")} == {
        k: want[k] for k in ("reward_mean", "grad_norm", "kl", "entropy")
    }
    a = load_file(os.path.join(tmp_path, "peft_adapter", "adapter_model.safetensors"))
    b = load_file(os.path.join(one_rank_lora, "peft_adapter", "adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in b)


LAYOUTS = {
    "dp_shard2_runtime": ["--parallelism.dp_shard=2", "--lora.generator=runtime"],
    # tp=2 with the merged generator: W + s B A on each TP shard
    "tp2_merged": ["--parallelism.tp=2", "--parallelism.dp_shard=1"],
}


# In the background from collection on (helpers/background.py).
background.register_train_jobs(
    "lora_two_ranks",
    ("tests/test_lora.py::test_two_rank_lora_matches_one_rank",),
    lambda folder: [[*SMALL, f"--job.dump_folder={folder}/{name}", *layout] for name, layout in LAYOUTS.items()],
    2,
)


@pytest.fixture(scope="module")
def two_rank_lora():
    """The run of `one_rank_lora` (without checkpoints) on 2 ranks in each of LAYOUTS, in one
    launch: {layout: folder}."""
    folder = background.torchrun_result("lora_two_ranks")
    return {name: os.path.join(folder, name) for name in LAYOUTS}


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_rank_lora_matches_one_rank(two_rank_lora, one_rank_lora, layout):
    tmp_path = two_rank_lora[layout]
    got, want = _metrics(tmp_path), _metrics(one_rank_lora)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert g["reward_mean"] == pytest.approx(w["reward_mean"], abs=1e-6)
        assert g["response_len"] == pytest.approx(w["response_len"], abs=1e-6)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3)
        assert g["kl"] == pytest.approx(w["kl"], rel=1e-3, abs=1e-7)
    a = load_file(os.path.join(tmp_path, "peft_adapter", "adapter_model.safetensors"))
    b = load_file(os.path.join(one_rank_lora, "peft_adapter", "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"lora.target_modules": ["qkv_proj"]}, "unknown target module 'qkv_proj'"),
        ({"lora.rank": 0}, "rank must be >= 1"),
        ({"job.recipe": "reward_model"}, "score head must train"),
        ({"float8.enable": True}, "cannot be combined"),
    ],
)
def test_lora_config_errors_name_the_fix(overrides, message):
    config = JobConfig()
    config.lora.enable = True
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(getattr(config, section), name, value)
    with pytest.raises(ValueError, match=message):
        config.validate()


def test_compiled_blocks_with_adapters_match_eager():
    config = JobConfig()
    config.lora = LoRAConfig(enable=True, rank=4, target_modules=ALL)
    eager = build_model(ARGS, ParallelDims(1, 1, 1, 1), config, torch.device("cpu"), lora=config.lora)
    config.compile.enable, config.compile.backend = True, "aot_eager"  # dynamo + AOTAutograd, quick to build
    compiled = build_model(ARGS, ParallelDims(1, 1, 1, 1), config, torch.device("cpu"), lora=config.lora)
    with torch.no_grad():
        for m in (eager, compiled):
            for module in m.modules():
                if isinstance(module, LoRALinear):
                    module.lora_b.weight.copy_(
                        torch.linspace(-0.1, 0.1, module.lora_b.weight.numel()).view_as(module.lora_b.weight)
                    )
    tokens = torch.randint(0, ARGS.vocab_size, (2, 9))
    for m in (eager, compiled):
        m(tokens).float().pow(2).mean().backward()
    torch.testing.assert_close(compiled(tokens), eager(tokens), atol=1e-5, rtol=1e-5)
    grads = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    for n, p in compiled.named_parameters():
        assert (p.grad is None) == (n not in grads), n  # the frozen base gets no gradient, compiled too
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[n], atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # the reference pass: adapters off inside the compiled blocks
        torch.testing.assert_close(_base_logits(compiled, tokens), _base_logits(eager, tokens), atol=1e-5, rtol=1e-5)
        assert (_base_logits(compiled, tokens) - compiled(tokens)).abs().max() > 1e-3


def test_critic_of_a_lora_policy_starts_from_its_merged_weights():
    """PPO with LoRA: the critic (fully trained, no adapters) copies the function the policy
    computes, W + (alpha / r) B A, not its frozen base."""
    from titanrl.components.model_builder import build_critic, copy_weights, policy_state_dict

    config = JobConfig()
    config.lora = LoRAConfig(enable=True, rank=4, target_modules=["wq", "w2"])
    policy = build_model(ARGS, ParallelDims(1, 1, 1, 1), config, torch.device("cpu"), lora=config.lora)
    with torch.no_grad():
        for module in policy.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.weight.normal_(0.0, 0.05)
    merged = policy_state_dict(policy)
    critic = build_critic(policy, ParallelDims(1, 1, 1, 1), config, torch.device("cpu"))
    for name, param in critic.named_parameters():
        if name != "output.weight":
            torch.testing.assert_close(param, merged[name], atol=0, rtol=0)
    assert not torch.equal(merged["layers.0.attention.wq.weight"], policy.layers["0"].attention.wq.weight)
    with torch.no_grad():
        critic.layers["0"].attention.wq.weight.zero_()
    copy_weights(critic, policy, skip=("output.weight",))  # what a fresh run's `prepare` does
    torch.testing.assert_close(critic.layers["0"].attention.wq.weight, merged["layers.0.attention.wq.weight"])


@pytest.mark.parametrize("mode", ["runtime", "merged"])
def test_generator_loads_the_frozen_base_once_with_runtime_adapters(mode):
    """Runtime adapters: after the first load only the trainable parameters are copied (the base
    is frozen; on FSDP2 ranks it is not all-gathered again). A frozen weight changed behind the
    trainer's back shows it: runtime keeps the first copy, merged re-merges every load."""
    from titanrl.config.generation import Generator as GeneratorConfig
    from titanrl.generator import Generator

    targets = ["wq", "wo", "w1", "w2"]
    trainer = _lora_model(targets=targets)
    freeze_base(trainer)
    lora = LoRAConfig(enable=True, rank=4, alpha=8.0, target_modules=targets, generator=mode)
    gen = Generator(
        ARGS,
        GeneratorConfig(num_blocks=64, block_size=8),
        torch.device("cpu"),
        lora=lora if mode == "runtime" else None,
    )  # no share_weights: the generator has its own copy
    gen.load_weights(trainer)
    first_norm = gen.model.norm.weight.clone()
    with torch.no_grad():
        trainer.norm.weight.add_(1.0)  # frozen: a job never changes it
        for module in trainer.modules():
            if isinstance(module, LoRALinear):
                module.lora_a.weight.add_(0.1)
    gen.load_weights(trainer)
    torch.testing.assert_close(
        gen.model.norm.weight, first_norm if mode == "runtime" else trainer.norm.weight, atol=0, rtol=0
    )
    if mode == "runtime":
        a_gen = gen.model.layers["0"].attention.wq.lora_a.weight
        torch.testing.assert_close(a_gen, trainer.layers["0"].attention.wq.lora_a.weight, atol=0, rtol=0)
    else:
        merged = merge_lora_state_dict(trainer.state_dict(), trainer)
        torch.testing.assert_close(
            gen.model.layers["0"].attention.wq.weight, merged["layers.0.attention.wq.weight"], atol=1e-6, rtol=0
        )


@pytest.mark.parametrize("mode", ["runtime", "merged"])
def test_int8_generator_follows_the_adapters(mode):
    """generator.quantize = 'int8' with LoRA: the base (merged: base + update) is re-quantised at
    each sync; runtime adapters stay in full precision. Logprobs follow an adapter change."""
    from titanrl.config.generation import Generator as GeneratorConfig
    from titanrl.generator import Generator, SamplingParams

    targets = ["wq", "wo", "w1", "w2"]
    trainer = _lora_model(targets=targets)
    lora = LoRAConfig(enable=True, rank=4, alpha=8.0, target_modules=targets, generator=mode)
    gen = Generator(
        ARGS,
        GeneratorConfig(num_blocks=64, block_size=8, quantize="int8"),
        torch.device("cpu"),
        lora=lora if mode == "runtime" else None,
    )
    assert not gen.share_weights(trainer)
    prompt = [1, 5, 9, 2, 7]
    diffs = []
    for change in range(2):
        if change:
            with torch.no_grad():
                for module in trainer.modules():
                    if isinstance(module, LoRALinear):
                        module.lora_b.weight.normal_(0.0, 0.3)  # a large update: stale weights would show
        gen.load_weights(trainer)
        (c,), _ = gen.generate([prompt], SamplingParams(max_new_tokens=6, temperature=1.0, n=1, seed=5))
        tokens = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            want = torch.log_softmax(trainer(tokens[:, :-1]).double(), -1)[0, len(prompt) - 1 :]
        want = want.gather(-1, tokens[0, len(prompt) :, None])[:, 0]
        diffs.append((torch.tensor(c.logprobs, dtype=torch.float64) - want).abs().max().item())
    assert all(1e-7 < d < 1e-2 for d in diffs), diffs  # int8 rounding (~1e-3); stale weights: ~0.1
