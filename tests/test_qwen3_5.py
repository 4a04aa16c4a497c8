"""Qwen3.5 (hybrid gated DeltaNet + gated full attention) against transformers' `qwen3_5_text`."""

import copy
import json
import os

import pytest
import torch
from helpers import background
from helpers.launch import REPO_ROOT

transformers = pytest.importorskip("transformers")

from titanrl.models import Transformer, gated_deltanet  # noqa: E402
from titanrl.models.delta_rule import recurrent_gated_delta_rule  # noqa: E402
from titanrl.models.hf import export_hf, load_hf_weights, read_hf_config  # noqa: E402
from titanrl.models.hf_common import map_name  # noqa: E402
from titanrl.models.hf_qwen3_5 import _TITAN_TO_HF  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation, which on a shared,
    loaded CPU costs more than the work (the file runs several times faster on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TOL = 1e-5  # max |logit diff| in float32
LENGTHS = [1, 5, 63, 64, 65, 150]


def _tiny_hf(std: float, bias: bool, seed: int):
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        attention_bias=bias,
        initializer_range=std,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(cfg)
    # Random norms, biases and gates so that a mis-mapped or mis-offset weight shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "A_log", "dt_bias")):
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module", params=[(0.02, False), (0.2, True)], ids=["std0.02", "std0.2-bias"])
def hf_folder(request, tmp_path_factory):
    std, bias = request.param
    folder = str(tmp_path_factory.mktemp("qwen3_5"))
    _tiny_hf(std, bias, seed=0).save_pretrained(folder)
    return folder


def titan_from_folder(folder: str, dtype: torch.dtype = torch.float32) -> Transformer:
    args = read_hf_config(folder)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()
    load_hf_weights(model, folder)
    return model.to(dtype).eval()


@pytest.fixture(scope="module")
def models(hf_folder):
    """transformers' model and titanrl's, loaded once per config."""
    return transformers.Qwen3_5ForCausalLM.from_pretrained(hf_folder).eval(), titan_from_folder(hf_folder)


def _prompts(n: int, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (LENGTHS[i % len(LENGTHS)],), generator=gen) for i in range(n)]


def test_config_maps_the_hybrid_layout(hf_folder):
    args = read_hf_config(hf_folder)
    assert args.family == "qwen3_5"
    assert [args.is_linear_layer(i) for i in range(4)] == [True, False, True, True]
    assert args.rotary_dim == 4 and args.attn_output_gate and args.qk_norm


def test_logits_match_transformers(models):
    hf, model = models
    with torch.no_grad():
        for tokens in _prompts(6):
            expected = hf(input_ids=tokens[None]).logits
            got = model(tokens[None])
            assert (got - expected).abs().max() < TOL, len(tokens)
        # A batch of two rows (the second sharing the first's prefix)
        rows = torch.stack([_prompts(5)[4][:40], torch.cat([_prompts(5)[4][:20], _prompts(5)[2][:20]])])
        assert (model(rows) - hf(input_ids=rows).logits).abs().max() < TOL


def test_export_reload_same_logits(models, tmp_path):
    model = models[1]
    export_hf(model, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == "qwen3_5_text"
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(str(tmp_path)).eval()
    again = titan_from_folder(str(tmp_path))
    tokens = _prompts(5)[4][None]
    with torch.no_grad():
        assert torch.equal(again(tokens), model(tokens))
        assert (hf(input_ids=tokens).logits - model(tokens)).abs().max() < TOL
    assert os.path.exists(tmp_path / "model.safetensors")


def test_packed_rows_reset_the_state_at_documents(models):
    """Three documents packed in one row (positions restart at 0) give each document's logits."""
    model = models[1]
    docs = [_prompts(6)[5][:70], _prompts(6)[1], _prompts(6)[0]]
    packed = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    from titanrl.models.attention import DocumentSDPA

    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        got = model(packed, positions, DocumentSDPA(doc_ids))[0].split([len(d) for d in docs])
        for doc, logits in zip(docs, got, strict=True):
            assert (logits - model(doc[None])[0]).abs().max() < TOL


def _titan_grads(folder: str, tokens: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    model = titan_from_folder(folder, dtype).train()
    logprobs, _ = model.logprobs(tokens[:, :-1], tokens[:, 1:], chunk_tokens=64)
    (-logprobs.mean()).backward()
    return {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


def test_training_step_gradients_match_float64(hf_folder, models, monkeypatch):
    """One loss's gradients (150 tokens: three chunks). In float64, through the chunked rule,
    within 1e-6 of the token-by-token recurrence (autograd through the plain loop); in float32,
    within float32 rounding of float64; and near transformers' (whose rule runs in float32)."""
    tokens = _prompts(6)[5][None]
    g64 = _titan_grads(hf_folder, tokens, torch.float64)
    g32 = _titan_grads(hf_folder, tokens, torch.float32)
    with monkeypatch.context() as patch:
        patch.setattr(gated_deltanet, "chunk_gated_delta_rule", recurrent_gated_delta_rule)
        reference = _titan_grads(hf_folder, tokens, torch.float64)
    hf = copy.deepcopy(models[0]).double().train()
    logits = hf(input_ids=tokens[:, :-1]).logits
    (-logits.log_softmax(-1).gather(-1, tokens[:, 1:, None]).mean()).backward()
    hf_params = dict(hf.named_parameters())
    assert g64.keys() == g32.keys() == reference.keys() and len(g64) == len(hf_params)
    qkv_rows = gated_deltanet.qkv_hf_order(read_hf_config(hf_folder))  # titanrl's key-head groups
    for name, grad in g64.items():
        scale = max(1.0, grad.abs().max().item())
        assert (grad - reference[name]).abs().max() < 1e-6 * scale, name
        assert (g32[name] - grad).abs().max() < 1e-4 * scale, name
        hf_grad = hf_params[map_name(name, _TITAN_TO_HF)].grad
        hf_grad = hf_grad[qkv_rows] if name.endswith(("in_proj_qkv.weight", "conv1d.weight")) else hf_grad
        assert (hf_grad - grad).abs().max() < 1e-4 * scale, name


background.register_torchrun(
    "qwen3_5_tp",
    ("tests/test_qwen3_5.py::test_two_rank_tensor_parallel_matches_one_rank",),
    os.path.join(REPO_ROOT, "tests", "multirank", "qwen3_5_parity_worker.py"),
    2,
    lambda folder: ["--out", f"{folder}/results.pt"],
)  # in the background from collection on (helpers/background.py)


@pytest.fixture(scope="module")
def tp_launched():
    """tp = 2 results from one 2-rank launch, and the 1-rank references."""
    import sys

    out = os.path.join(background.torchrun_result("qwen3_5_tp"), "results.pt")
    sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "multirank"))
    import qwen3_5_parity_worker as worker

    return torch.load(out), {dtype: worker.run_layout(1, dtype, world_size=1) for dtype in ("float32", "float64")}


@pytest.mark.multirank
def test_two_rank_tensor_parallel_matches_one_rank(tp_launched):
    """2 AdamW steps with the gated DeltaNet's key-head groups, the gated attention's heads and
    the MLP split over 2 gloo ranks (tp) equal one rank's: losses, every gradient and parameter;
    then the tp = 2 generator's greedy tokens and logprobs equal a one-rank recompute's."""
    results, references = tp_launched
    placements = results["float64"]["placements"]
    for name in ("in_proj_qkv.weight", "conv1d.weight", "A_log", "out_proj.weight"):
        assert "Shard" in placements[f"layers.0.linear_attn.{name}"], name
    assert "Replicate" in placements["layers.0.linear_attn.norm.weight"]
    # float32: different reduction orders (~4e-8 on gradients, AdamW turns that into ~2e-5 on
    # near-zero-gradient parameters); float64 shows the two compute the same thing.
    for dtype, tol, param_tol in (("float32", 1e-6, 1e-4), ("float64", 1e-12, 1e-12)):
        got, ref = results[dtype], references[dtype]
        assert got["losses"] == pytest.approx(ref["losses"], abs=tol)
        assert got["grads"].keys() == ref["grads"].keys() == got["params"].keys()
        assert max((got["grads"][k] - ref["grads"][k]).abs().max().item() for k in ref["grads"]) < tol
        assert max((got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"]) < param_tol
        assert ref["losses"][1] < ref["losses"][0] - 0.1  # the steps did something
    # A tp-sharded generator synced from the tp trainer (state slots of 1 / tp of the heads, chunked
    # prefill, group samples) decodes as a one-rank full recompute.
    generated = results["float32"]["generated"]
    assert generated["n"] == 6 and generated["mismatches"] == 0 and generated["max_lp_diff"] < 1e-5, generated


@pytest.mark.parametrize(
    "flavor,total",
    # Text model only: the checkpoints' names also count the vision tower (and the MTP layer).
    [("qwen3.5-0.8b", 752_393_024), ("qwen3.5-4b", 4_205_751_296), ("qwen3.5-9b", 8_953_803_264)],
)
def test_released_flavors_match_transformers_shapes(flavor, total):
    """The flavor's parameter count equals transformers' Qwen3_5ForCausalLM built from the
    config titanrl exports for it, and that config reads back to the same args."""
    from titanrl.models.flavors import get_model_args
    from titanrl.models.hf_qwen3_5 import args_from_hf_config, hf_config_from_args

    args = get_model_args(flavor)
    cfg = hf_config_from_args(args, torch.bfloat16)
    with torch.device("meta"):
        n_titan = sum(p.numel() for p in Transformer(args).parameters())
        text_cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
        hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text_cfg))
    print(f"{flavor}: {n_titan / 1e9:.3f}B parameters (text model)")
    assert n_titan == sum(p.numel() for p in hf.parameters()) == total
    assert args_from_hf_config(cfg) == args


# ---- the paged generator: state slots beside the KV pool ----

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gen_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3_5_gen"))
    _tiny_hf(0.2, True, seed=3).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_greedy(gen_folder):
    """transformers' greedy tokens and their logprobs for 12 prompts (two sharing a prefix)."""
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(gen_folder).eval()
    prompts = [p.tolist() for p in _prompts(12, seed=5)]
    prompts[11] = prompts[4][:40] + prompts[11][:7]
    # One left-padded batch (the linear layers zero padded positions' inputs, so their state
    # stays zero until a row's prompt starts; one call instead of twelve).
    L = max(map(len, prompts))
    ids_BL = torch.zeros(len(prompts), L, dtype=torch.long)
    mask_BL = torch.zeros_like(ids_BL)
    for i, prompt in enumerate(prompts):
        ids_BL[i, L - len(prompt) :] = torch.tensor(prompt)
        mask_BL[i, L - len(prompt) :] = 1
    with torch.no_grad():
        out = hf.generate(
            ids_BL,
            attention_mask=mask_BL,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    results = []
    for i in range(len(prompts)):
        tokens = out.sequences[i, L:].tolist()
        logprobs = [lg[i].log_softmax(-1)[t].item() for lg, t in zip(out.logits, tokens, strict=True)]
        results.append((tokens, logprobs))
    return prompts, results


def _generate(folder: str, prompts, n: int = 1, **config):
    from titanrl.config.generation import Generator as GeneratorConfig
    from titanrl.generator.generator import Generator
    from titanrl.generator.sampling import SamplingParams

    gen = Generator(read_hf_config(folder), GeneratorConfig(**{"num_blocks": 256, **config}), torch.device("cpu"))
    gen.load_hf(folder)
    completions, stats = gen.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, n=n))
    return gen, completions, stats


def _assert_matches(completions, expected, n: int = 1):
    assert len(completions) == n * len(expected)
    for c in completions:
        tokens, logprobs = expected[c.prompt_index]
        assert c.token_ids == tokens, (c.prompt_index, c.sample_index)
        assert max(abs(a - b) for a, b in zip(c.logprobs, logprobs, strict=True)) < 1e-4


def test_generator_greedy_matches_transformers_all_12_batched(gen_folder, hf_greedy):
    prompts, expected = hf_greedy
    gen, completions, stats = _generate(gen_folder, prompts)
    _assert_matches(completions, expected)
    assert gen.state_slots is not None and gen.state_slots.num_free == gen.config.max_num_seqs


def test_generator_chunked_prefill_carries_the_state(gen_folder, hf_greedy):
    prompts, expected = hf_greedy
    _, completions, stats = _generate(gen_folder, prompts, max_num_batched_tokens=48)
    assert stats.prefill_chunks > 0
    _assert_matches(completions, expected)


def test_generator_preemption_mid_decode_same_tokens(gen_folder, hf_greedy):
    prompts, expected = hf_greedy
    _, completions, stats = _generate(gen_folder, prompts, num_blocks=16, block_size=16)
    assert stats.preemptions > 0
    _assert_matches(completions, expected)


def test_generator_group_samples_share_the_prompt_state(gen_folder, hf_greedy):
    """GRPO groups: every greedy sample continues from a copy of its prompt's state."""
    prompts, expected = hf_greedy
    _, completions, _ = _generate(gen_folder, prompts[:4], n=3)
    _assert_matches(completions, expected[:4], n=3)


def _slot_bytes(args) -> int:
    """One sequence's state, by hand: per linear layer the conv inputs and the float32 matrix."""
    conv_dim = 2 * args.linear_num_key_heads * args.linear_key_head_dim
    conv_dim += args.linear_num_value_heads * args.linear_value_head_dim
    per_layer = 4 * (conv_dim * (args.linear_conv_kernel_dim - 1))
    per_layer += 4 * args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim
    return 3 * per_layer  # three linear layers


def test_recurrent_state_memory_is_constant_in_length(gen_folder, monkeypatch):
    """A sequence holds one slot of fixed bytes whatever its length (a 3- and a 150-token prompt,
    prefilled in chunks), while its KV blocks grow with it."""
    from titanrl.generator.state_slots import StateSlots

    allocations = []
    allocate = StateSlots.allocate
    monkeypatch.setattr(StateSlots, "allocate", lambda self: allocations.append(1) or allocate(self))
    gen, completions, stats = _generate(
        gen_folder, [list(range(3)), list(range(150))], max_num_seqs=2, max_num_batched_tokens=48
    )
    assert stats.prefill_chunks > 0 and len(completions) == 2
    assert gen.state_slots.nbytes == 3 * _slot_bytes(read_hf_config(gen_folder))  # two slots and the scratch one
    assert len(allocations) == 2  # one per sequence, across its chunks and its decode steps


def test_kv_pool_has_pages_for_full_attention_layers_only(gen_folder):
    """Layers 0, 2, 3 are linear: their K/V page tensors are empty; layer 1's hold the pool."""
    args = read_hf_config(gen_folder)
    gen, _, _ = _generate(gen_folder, [list(range(20))], num_blocks=8, block_size=16)
    page_bytes = 16 * args.n_kv_heads * args.head_dim * 4
    for layer in range(4):
        numel = 0 if args.is_linear_layer(layer) else 9 * 16 * args.n_kv_heads * args.head_dim
        assert gen.pool.k[layer].numel() == gen.pool.v[layer].numel() == numel, layer
    assert gen.pool.nbytes == gen.kv_cache_bytes == 2 * 9 * page_bytes  # 8 blocks + the scratch one
    assert gen._bytes_per_block() == 2 * page_bytes


def test_state_slots_are_counted_in_the_memory_budget(gen_folder, monkeypatch):
    """num_blocks = 0: the KV pool gets the memory fraction less the state slots' bytes."""
    from titanrl.config.generation import Generator as GeneratorConfig
    from titanrl.generator import kv_cache
    from titanrl.generator.generator import Generator

    args = read_hf_config(gen_folder)
    per_block = 2 * 16 * args.n_kv_heads * args.head_dim * 4  # one full-attention layer
    slots = 9 * _slot_bytes(args)  # max_num_seqs 8 + scratch
    free_bytes = 100 * per_block + slots
    monkeypatch.setattr(kv_cache.os, "sysconf", lambda name: free_bytes if name == "SC_AVPHYS_PAGES" else 1)
    config = GeneratorConfig(num_blocks=0, block_size=16, max_num_seqs=8, kv_cache_memory_fraction=1.0)
    gen = Generator(args, config, torch.device("cpu"))
    assert gen.state_slots.nbytes == slots
    assert gen.num_blocks == 96  # 100, rounded down to 4 significant bits: the slots did not take KV blocks
    config.max_num_seqs = 8 + 100 * per_block // _slot_bytes(args) // 2  # slots now take about half
    assert Generator(args, config, torch.device("cpu")).num_blocks < 60


# ---- the debug flavor and its recipe ----


def test_debug_recipe_trains_the_hybrid_debug_flavor():
    """The recipe trains debug-qwen3.5 (the dense debug flavor's width, three of four layers
    linear) on the reverse task with the byte tokenizer."""
    from helpers.launch import REPO_ROOT

    from titanrl.config.manager import load_config
    from titanrl.models.flavors import get_model_args
    from titanrl.models.tokenizer import ByteTokenizer

    config = load_config([f"--job.config_file={REPO_ROOT}/train_configs/grpo_reverse_qwen35_debug.toml"])
    args = get_model_args(config.model.flavor)
    assert config.model.flavor == "debug-qwen3.5" and config.data.task == "reverse"
    assert [args.is_linear_layer(i) for i in range(4)] == [True, True, True, False]
    with torch.device("meta"):
        n = sum(p.numel() for p in Transformer(args).parameters())
    assert 1e6 < n < 10e6 and args.vocab_size >= ByteTokenizer().vocab_size


@pytest.mark.parametrize(
    "degrees, message",
    [({"tp": 4}, r"tp = 4 must divide linear_num_key_heads \(2\)"), ({"cp": 2}, "cp = 2 is not supported")],
)
def test_indivisible_tensor_and_any_context_parallelism_are_refused(degrees, message):
    """One-line errors before any mesh is touched: tp must divide the linear layers' key and
    value heads (debug-qwen3.5 has 2 and 4); a dense model passes the same check."""
    from titanrl.config import load_config
    from titanrl.distributed.parallel_dims import ParallelDims
    from titanrl.distributed.parallelize import parallelize_model
    from titanrl.models.flavors import get_model_args
    from titanrl.models.gated_deltanet import check_parallelism

    world = max(degrees.values())
    dims = ParallelDims(dp_replicate=1, dp_shard=1, world_size=world, **{"tp": 1, "cp": 1, **degrees})
    with torch.device("meta"):
        model = Transformer(get_model_args("debug-qwen3.5"))
    with pytest.raises(ValueError, match=message):
        parallelize_model(model, dims, load_config([]))
    check_parallelism(get_model_args("debug"), 4, 2)
    check_parallelism(get_model_args("debug-qwen3.5"), 2, 1)


def test_lora_adapts_the_linear_attention_projections(gen_folder):
    """Targets of both kinds of block: each block gets those it has; the adapted model equals
    its merged weights, and the linear layers' adapters get gradients."""
    from titanrl.config.model import LoRA as LoRAConfig
    from titanrl.models.flavors import get_model_args
    from titanrl.models.lora import add_lora, freeze_base, merge_lora_state_dict

    targets = ["wq", "wk", "wv", "wo", "in_proj_qkv", "in_proj_z", "out_proj"]
    model = titan_from_folder(gen_folder)
    assert add_lora(model, LoRAConfig(enable=True, rank=4, target_modules=targets)) == 3 * 3 + 4
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b.weight"):
                p.copy_(0.1 * torch.randn_like(p))
    plain = titan_from_folder(gen_folder)
    plain.load_state_dict(merge_lora_state_dict(model.state_dict(), model))
    tokens = _prompts(6)[5][None]
    with torch.no_grad():
        assert (model(tokens) - plain(tokens)).abs().max() < 1e-4  # float32: W x + B A x vs (W + B A) x
    freeze_base(model)
    model(tokens).logsumexp(-1).mean().backward()
    assert model.layers["0"].linear_attn.in_proj_qkv.lora_a.weight.grad.abs().sum() > 0
    assert model.layers["0"].linear_attn.in_proj_qkv.weight.grad is None
    with torch.device("meta"):
        dense = Transformer(get_model_args("debug"))
    with pytest.raises(ValueError, match="no layer has the target_modules"):
        add_lora(dense, LoRAConfig(enable=True, target_modules=["in_proj_qkv"]))


def test_batch_invariant_generation_is_refused(gen_folder):
    with pytest.raises(ValueError, match="batch_invariant = true is not supported for hybrid"):
        _generate(gen_folder, [[1, 2, 3]], batch_invariant=True)


background.register(
    "bench_hybrid",
    ("tests/test_qwen3_5.py::test_bench_gpu_hybrid_section_dry_run",),
    lambda folder: ["bash", f"{REPO_ROOT}/scripts/bench_gpu.sh", "--hybrid-only", "--dry-run"],
    {"PYTHONPATH": REPO_ROOT},
)  # in the background from collection on (helpers/background.py)


def test_bench_gpu_hybrid_section_dry_run():
    """scripts/bench_gpu.sh --hybrid-only --dry-run: the section's code path on the CPU. Per
    context length, the hybrid holds a quarter of the dense model's KV and a state that does not
    grow with the context."""
    import ast

    proc, _ = background.result("bench_hybrid", timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ast.literal_eval(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    dense, hybrid = rows[0::2], rows[1::2]
    assert [r["flavor"] for r in hybrid] == ["debug-qwen3.5"] * 2 and [r["context"] for r in hybrid] == [36, 68]
    for d, h in zip(dense, hybrid, strict=True):
        assert h["kv_bytes_per_seq"] * 4 == d["kv_bytes_per_seq"] and d["state_bytes_per_seq"] == 0
        assert h["decode_tokens_per_s"] > 0 and d["decode_tokens_per_s"] > 0
    assert hybrid[0]["state_bytes_per_seq"] == hybrid[1]["state_bytes_per_seq"] > 0
