"""DeepSeek-V3 (multi-head latent attention, sigmoid group-limited MoE) against transformers on
tiny random checkpoints: logits, export and round trip, MTP layers skipped, the paged generator
over the compressed latent (greedy tokens, logprobs, cache bytes), gradients of a training step
against a float64 reference, the router alone, and the published flavor sizes."""

import logging
import os

import pytest
import torch
from helpers import background
from helpers.launch import REPO_ROOT

transformers = pytest.importorskip("transformers")

from titanrl.config.generation import Generator as GeneratorConfig  # noqa: E402
from titanrl.generator import Generator, SamplingParams  # noqa: E402
from titanrl.generator.kv_cache import KVCachePool  # noqa: E402
from titanrl.models import Transformer, get_model_args  # noqa: E402
from titanrl.models.hf import (  # noqa: E402
    export_hf,
    from_hf_state_dict,
    load_hf_weights,
    load_safetensors_folder,
    read_hf_config,
    save_safetensors_folder,
    to_hf_state_dict,
)
from titanrl.models.mla import latent_cache_dims  # noqa: E402
from titanrl.models.moe import TopKRouter  # noqa: E402

TOL = 1e-5  # max |logit diff| in float32
VOCAB = 300
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
# (q_lora_rank, YaRN, init std, attention_bias)
CONFIGS = {"q_lora-yarn-std0.2-bias": (16, True, 0.2, True), "plain_q-std0.02": (None, False, 0.02, False)}


def _tiny_hf(q_lora_rank, yarn, std, bias, dtype=torch.float32):
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=24,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        max_position_embeddings=128,
        rope_parameters=YARN if yarn else {"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=std,
        attention_bias=bias,
        num_nextn_predict_layers=0,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norm weights and biases away from 1 and 0
            if "norm" in name or name.endswith("bias"):
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each tiny configuration saved once for the whole module: name -> (folder, transformers model)."""
    saved: dict[str, tuple] = {}

    def get(name: str):
        if name not in saved:
            hf_model = _tiny_hf(*CONFIGS[name])
            folder = tmp_path_factory.mktemp(name) / "hf"
            hf_model.save_pretrained(folder)
            saved[name] = folder, hf_model
        return saved[name]

    return get


@pytest.fixture(scope="module", params=list(CONFIGS))
def hf_folder(request, checkpoints):
    return checkpoints(request.param)


def _titan_from_folder(folder) -> Transformer:
    with torch.device("meta"):
        model = Transformer(read_hf_config(str(folder)))
    model.to_empty(device="cpu")
    model.init_weights()
    load_hf_weights(model, str(folder))
    return model.eval()


def _tokens(B=3, T=37, seed=1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def test_logits_export_and_round_trip_match_transformers(hf_folder, tmp_path):
    folder, hf_model = hf_folder
    model = _titan_from_folder(folder)
    assert [i for i, b in model.layers.items() if b.moe is not None] == ["1", "2"]  # first_k_dense_replace=1
    tokens_BT = _tokens()
    with torch.no_grad():
        ref = hf_model(input_ids=tokens_BT).logits
        ours = model(tokens_BT)
    assert (ours - ref).abs().max().item() < TOL

    export_hf(model, str(tmp_path / "export"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    assert type(reloaded) is type(hf_model)
    with torch.no_grad():
        assert (reloaded(input_ids=tokens_BT).logits - ref).abs().max().item() < TOL
    # Round trip: every tensor of the checkpoint comes back bit for bit.
    original, exported = load_safetensors_folder(str(folder)), load_safetensors_folder(str(tmp_path / "export"))
    assert set(exported) <= set(original)
    assert all(torch.equal(exported[k], original[k]) for k in exported)
    assert set(original) - set(exported) <= {k for k in original if ".mlp.experts." in k}  # fused vs per expert
    sd = from_hf_state_dict(to_hf_state_dict(model.state_dict(), model.args), model.args)
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


def test_mtp_layers_are_skipped_with_one_notice(hf_folder, tmp_path, caplog):
    folder, hf_model = hf_folder
    hf_sd = load_safetensors_folder(str(folder))
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v for k, v in hf_sd.items() if "model.layers.2." in k}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(48, 96)
    save_safetensors_folder({**hf_sd, **mtp}, str(tmp_path))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    # The "titanrl" logger does not propagate once components/console.py set it up: caplog's
    # handler goes on it, with propagation off either way (else a run of this test alone sees
    # each record twice, through the logger and through the root).
    titanrl_logger = logging.getLogger("titanrl")
    propagate = titanrl_logger.propagate
    titanrl_logger.addHandler(caplog.handler)
    titanrl_logger.propagate = False
    try:
        with caplog.at_level(logging.WARNING):
            model = _titan_from_folder(tmp_path)
    finally:
        titanrl_logger.removeHandler(caplog.handler)
        titanrl_logger.propagate = propagate
    notices = [r for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(notices) == 1 and f"Skipping {len(mtp)} weights" in notices[0].getMessage()
    with torch.no_grad():
        assert (model(_tokens()) - hf_model(input_ids=_tokens()).logits).abs().max().item() < TOL


@pytest.fixture(scope="module")
def generate_reference(checkpoints):
    """The YaRN / q_lora checkpoint, 12 prompts (two of them prefix-cache hits on a third) and
    transformers' greedy completions (one left-padded `generate` call) with their logprobs in
    float64 (one unpadded forward per prompt)."""
    folder, hf_model = checkpoints("q_lora-yarn-std0.2-bias")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 3, 5, 8, 9, 13, 17, 21, 30, 4, 11, 25)]
    prompts[9], prompts[11] = prompts[8][:4], prompts[8][:25]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf_model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )[:, width:]
    completions = []
    for prompt, tokens in zip(prompts, out, strict=True):
        full = torch.tensor([prompt + tokens.tolist()])
        with torch.no_grad():
            logits = hf_model(input_ids=full).logits[0, len(prompt) - 1 : -1].double()
        completions.append((tokens.tolist(), torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]))
    return folder, prompts, completions


@pytest.mark.parametrize("attention_impl", ["auto", "exact"])
def test_paged_generator_over_the_latent_matches_transformers_generate(generate_reference, attention_impl):
    folder, prompts, reference = generate_reference
    args = read_hf_config(str(folder))
    block_size, num_blocks = 4, 128
    config = GeneratorConfig(block_size=block_size, num_blocks=num_blocks, attention_impl=attention_impl)
    gen = Generator(args, config, torch.device("cpu"))
    gen.load_hf(str(folder))
    # The pool holds kv_lora_rank + qk_rope_head_dim values per token and layer, nothing per head.
    assert gen.pool is not None
    assert gen.pool.nbytes == (num_blocks + 1) * block_size * args.n_layers * (24 + 8) * 4
    completions, _ = gen.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
    for completion, (tokens, logprobs) in zip(completions, reference, strict=True):
        assert completion.token_ids == tokens
        assert (torch.tensor(completion.logprobs, dtype=torch.float64) - logprobs).abs().max().item() < 1e-4


def test_cache_bytes_per_token_follow_the_latent_formula():
    """n_layers * (kv_lora_rank + qk_rope_head_dim) * element size bytes a token, whatever the heads."""
    args = get_model_args("debug-deepseek-v3")
    gen = Generator(args, GeneratorConfig(block_size=16, num_blocks=4), torch.device("cpu"), dtype=torch.bfloat16)
    per_token = args.n_layers * (args.kv_lora_rank + args.qk_rope_head_dim) * 2
    assert gen.pool is not None and gen.pool.nbytes == (4 + 1) * 16 * per_token
    assert gen._bytes_per_block() == 16 * per_token
    assert gen.pool.v is gen.pool.k  # V is the latent
    # DeepSeek-V3-671B in bf16: 61 x (512 + 64) x 2 = 70,272 bytes a token (per-head K/V: 61 x 128 x 320 x 2).
    heads, dim = latent_cache_dims(get_model_args("deepseek-v3-671b"))
    assert KVCachePool.bytes_per_block(61, 1, heads, dim, torch.bfloat16, latent=True) == 70272


def _grads(model: torch.nn.Module, tokens_BT: torch.Tensor, logits_fn) -> dict[str, torch.Tensor]:
    model.zero_grad()
    logits = logits_fn(tokens_BT[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens_BT[:, 1:].flatten())
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_training_step_gradients_match_a_float64_reference(tmp_path):
    """One step's gradients in float32 against transformers' model in float64, by HF name."""
    hf64 = _tiny_hf(*CONFIGS["plain_q-std0.02"], dtype=torch.float64)
    hf64.set_experts_implementation("eager")  # grouped_mm has no float64
    hf64.save_pretrained(tmp_path)
    model = _titan_from_folder(tmp_path).train()
    tokens_BT = _tokens(2, 25, seed=3)
    ours = to_hf_state_dict(_grads(model, tokens_BT, model), model.args)
    ref = _grads(hf64, tokens_BT, lambda t: hf64(input_ids=t).logits)
    ref = to_hf_state_dict(from_hf_state_dict(ref, model.args), model.args)  # experts per expert
    assert set(ours) == set(ref) and len(ours) > 30
    worst = max((ours[k].double() - ref[k]).abs().max().item() for k in ours)
    assert worst < 1e-6, worst


def test_router_matches_transformers_group_limited_routing():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(
        hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5
    )
    hf_router = DeepseekV3TopkRouter(cfg)
    router = TopKRouter(16, 16, 4, True, "sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    with torch.no_grad():
        router.gate.weight.copy_(torch.randn(16, 16))
        hf_router.weight.copy_(router.gate.weight)
        hf_router.e_score_correction_bias.copy_(0.3 * torch.randn(16))
    x_TD = torch.randn(64, 16)
    _, hf_weights, hf_experts = hf_router(x_TD)
    weights, experts, _ = router(x_TD, hf_router.e_score_correction_bias)
    hf_order, order = hf_experts.argsort(-1), experts.argsort(-1)
    assert torch.equal(hf_experts.gather(1, hf_order), experts.gather(1, order))
    assert torch.allclose(hf_weights.gather(1, hf_order), weights.gather(1, order), atol=1e-6)
    # Group-limited: every token's experts lie in 2 of the 4 groups, and it matters here.
    assert all(len(set((row // 4).tolist())) <= 2 for row in experts)
    free = TopKRouter(16, 16, 4, True, "sigmoid", routed_scaling_factor=2.5)
    free.load_state_dict(router.state_dict())
    assert not torch.equal(free(x_TD, hf_router.e_score_correction_bias)[1].sort(-1).values, experts.sort(-1).values)


@pytest.mark.parametrize(
    "flavor,total,active",
    [
        # Published: Moonlight-16B-A3B ~16B total / ~3B active; DeepSeek-V3 671B / 37B (main model).
        ("moonlight-16b-a3b", 15_960_108_544, 2_914_774_528),
        ("deepseek-v3-671b", 671_026_404_352, 37_552_282_624),
    ],
)
def test_flavors_have_the_published_parameter_counts(flavor, total, active):
    with torch.device("meta"):
        model = Transformer(get_model_args(flavor))
    n_total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    n_active = n_total - routed + routed * model.args.moe_top_k // model.args.moe_num_experts
    print(f"{flavor}: {n_total / 1e9:.2f}B total, {n_active / 1e9:.2f}B active")
    assert (n_total, n_active) == (total, active)
    published_total, published_active = {"moonlight-16b-a3b": (16, 3), "deepseek-v3-671b": (671, 37)}[flavor]
    assert abs(n_total / 1e9 - published_total) < 0.05 and abs(n_active / 1e9 - published_active) < 0.6


@pytest.mark.parametrize("mode", ["runtime", "merged"])
def test_lora_on_mla_reaches_the_absorbed_generator(checkpoints, tmp_path, mode):
    """wq / wk / wv / wo adapt MLA's wq_a, wq_b, wkv_a, wkv_b and wo; the generator, which reads
    wkv_b's weight in its weight-absorbed attention, serves base + adapter as the trainer does
    (adapters at runtime, or merged at the sync), and a PEFT export names the HF projections."""
    import json

    from titanrl.config.model import LoRA as LoRAConfig
    from titanrl.models.hf import export_peft_adapter
    from titanrl.models.lora import LoRALinear, add_lora, init_lora, lora_modules

    folder, _ = checkpoints("q_lora-yarn-std0.2-bias")
    trainer = _titan_from_folder(folder)
    lora = LoRAConfig(enable=True, rank=4, alpha=8.0, generator=mode)
    assert add_lora(trainer, lora) == 5 * trainer.args.n_layers
    init_lora(trainer, seed=0)
    with torch.no_grad():
        for module in trainer.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.weight.normal_(0.0, 0.05)
    assert {name.split(".")[-1] for name, _ in lora_modules(trainer)} == {"wq_a", "wq_b", "wkv_a", "wkv_b", "wo"}
    gen = Generator(trainer.args, GeneratorConfig(num_blocks=64, block_size=4), torch.device("cpu"), lora=lora)
    if mode == "merged":
        gen = Generator(trainer.args, GeneratorConfig(num_blocks=64, block_size=4), torch.device("cpu"))
    gen.load_weights(trainer)
    prompts = [[1, 5, 9, 2, 7, 7], [3, 3, 7]]
    completions, _ = gen.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=3))
    for i, c in enumerate(completions):
        prompt = prompts[i // 2]
        tokens = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            want = torch.log_softmax(trainer(tokens[:, :-1]).double(), -1)[0, len(prompt) - 1 :]
        want = want.gather(-1, tokens[0, len(prompt) :, None])[:, 0]
        assert (torch.tensor(c.logprobs, dtype=torch.float64) - want).abs().max().item() < 1e-5
    if mode == "merged":
        export_peft_adapter(trainer, str(tmp_path), lora.rank, lora.alpha, lora.dropout)
        targets = json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"]
        assert targets == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]


def test_context_parallelism_refuses_multi_head_latent_attention():
    from types import SimpleNamespace

    from titanrl.config.job_config import JobConfig
    from titanrl.distributed.parallelize import parallelize_model

    with torch.device("meta"):
        model = Transformer(get_model_args("debug-deepseek-v3"))
    with pytest.raises(ValueError, match="cp = 2 does not support multi-head latent attention"):
        parallelize_model(model, SimpleNamespace(cp=2), JobConfig())  # type: ignore[arg-type]  # refused first


background.register(
    "bench_deepseek",
    ("tests/test_deepseek_v3.py::test_bench_gpu_deepseek_section_dry_run",),
    lambda folder: [
        "bash",
        f"{REPO_ROOT}/scripts/bench_gpu.sh",
        "--deepseek-only",
        "--dry-run",
        "--out",
        f"{folder}/bench.json",
    ],
    {"OMP_NUM_THREADS": "1"},
)  # in the background from collection on (helpers/background.py)


def test_bench_gpu_deepseek_section_dry_run():
    """scripts/bench_gpu.sh --deepseek-only on the CPU (debug flavor): every number present and
    consistent, so that a GPU run of the two DeepSeek-V3-shaped layers is right the first time."""
    import json

    proc, folder = background.result("bench_deepseek", timeout_s=300)
    out = folder / "bench.json"
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())["results"]
    args = get_model_args("debug-deepseek-v3")
    assert report["model"] == "debug-deepseek-v3" and report["dry_run"] is True
    assert report["latent_bytes_per_token"] == args.n_layers * (args.kv_lora_rank + args.qk_rope_head_dim) * 4
    assert [row["batch"] for row in report["decode"]] == [1, 4]
    for row in report["decode"]:
        assert row["decode_tok_s"] > 0 and row["fraction_of_roofline"] == row["decode_tok_s"] / row["roofline_tok_s"]
    train = report["train"]
    assert train["tokens_per_s"] > 0 and train["mfu"] is None  # no peak known on CPU
    assert 2_000_000 < train["active_params"] < sum(p.numel() for p in Transformer(args).parameters())


background.register_torchrun(
    "dsv3_parallel",
    ("tests/test_deepseek_v3.py::test_two_rank_expert_and_tensor_parallel_match_one_rank",),
    os.path.join(REPO_ROOT, "tests", "multirank", "deepseek_parity_worker.py"),
    2,
    lambda folder: ["--out", f"{folder}/results.pt"],
)  # in the background from collection on (helpers/background.py)


@pytest.fixture(scope="module")
def launched():
    """Both layouts' results from one 2-rank launch, and the 1-rank reference for each dtype."""
    import sys

    out = os.path.join(background.torchrun_result("dsv3_parallel"), "results.pt")
    sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "multirank"))
    import deepseek_parity_worker as worker

    references = {dtype: worker.run_layout(None, dtype, world_size=1) for dtype in ("float32", "float64")}
    return torch.load(out), references


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["ep2", "tp2"])
def test_two_rank_expert_and_tensor_parallel_match_one_rank(launched, layout):
    """2 AdamW steps with the experts over 2 gloo ranks (ep) or MLA's heads and the dense
    layer split over 2 (tp) equal one rank's, in float32 and float64."""
    results, references = launched
    # float32 parameters: AdamW turns a 3e-7 gradient difference on a near-zero gradient into
    # ~1e-5 of update after the tp all-reduces (float64 shows the layouts compute the same thing).
    for dtype, tol, param_tol in (("float32", 1e-5, 5e-5), ("float64", 1e-10, 1e-10)):
        got, ref = results[f"{layout}/{dtype}"], references[dtype]
        assert got["losses"] == pytest.approx(ref["losses"], abs=tol)
        assert got["grads"].keys() == ref["grads"].keys()
        assert max((got["grads"][k] - ref["grads"][k]).abs().max().item() for k in ref["grads"]) < tol
        assert max((got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"]) < param_tol
        assert ref["losses"][1] < ref["losses"][0] - 0.1  # the steps did something
