"""Quantised rollout (generator.quantize): the int8 generator computes with exactly the int8
weights of the trainer's current values (checked against a dequantised reference built here),
re-quantises at every sync in place, never shares storage with the trainer, decodes the same
tokens compiled and eager, and an RL step with it logs a nonzero sampler/trainer mismatch that
the TIS correction sees. Memory at the real vocabulary is measured."""

import math
import os

import pytest
import torch
from helpers.launch import REPO_ROOT
from helpers.reference import greedy_reference
from helpers.tiny import tiny_model, tiny_model_args

from titanrl.config import load_config
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.generator.quantize import BLOCK_PROJECTIONS, check_quantize_supported, is_quantized
from titanrl.generator.weight_sync import weight_bytes
from titanrl.models import Transformer, TransformerModelArgs

ARGS = tiny_model_args()
CONFIGS = os.path.join(REPO_ROOT, "train_configs")


def _trainer_model(seed: int = 0, args: TransformerModelArgs = ARGS) -> Transformer:
    model = tiny_model(args, seed)
    return model.eval()


def _generator(model: Transformer, **config) -> Generator:
    gen = Generator(ARGS, GeneratorConfig(**{"block_size": 4, "num_blocks": 128, **config}), torch.device("cpu"))
    gen.load_weights(model)
    return gen


def _int8_reference(model: Transformer) -> Transformer:
    """`model` with every block projection replaced by its symmetric per-row int8 value, written
    out here: scale = max|w_row| / 127.5, q = clamp(round(w * (1 / scale)), -128, 127), w' = q * scale
    (torchao multiplies by the reciprocal: dividing rounds ~1 weight in 200 the other way)."""
    ref = _trainer_model(args=model.args)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for fqn, module in ref.named_modules():
            if fqn.startswith("layers.") and fqn.rsplit(".", 1)[-1] in BLOCK_PROJECTIONS:
                w = module.weight
                scale = (w.abs().amax(dim=1, keepdim=True) / 127.5).clamp(min=torch.finfo(torch.float32).eps)
                w.copy_((w * (1.0 / scale)).round().clamp(-128, 127) * scale)
    return ref


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100, (n,), generator=g).tolist() for n in lengths]


def test_int8_weights_are_int8_and_logits_match_the_dequantised_reference():
    """Block projections hold int8 data (embedding and LM head stay float32); the generator's
    logits equal a float model with the dequantised int8 weights (1e-5: only the matmul order
    differs) and differ from the full-precision model's by the quantisation error (stated bound
    0.05 on logits of magnitude ~1; measured ~5e-3), not by nothing."""
    model = _trainer_model()
    gen = _generator(model, quantize="int8")
    quantised = {n for n, p in gen.model.named_parameters() if is_quantized(p)}
    assert len(quantised) == 7 * ARGS.n_layers and all(n.startswith("layers.") for n in quantised)
    assert all(gen.model.get_parameter(n).qdata.dtype == torch.int8 for n in quantised)
    assert not is_quantized(gen.model.output.weight) and gen.model.output.weight.dtype == torch.float32
    tokens = torch.tensor([_prompts([40])[0]])
    with torch.no_grad():
        logits_q, logits_fp = gen.model(tokens), model(tokens)
        logits_ref = _int8_reference(model)(tokens)
    torch.testing.assert_close(logits_q, logits_ref, rtol=0, atol=1e-5)
    diff = (logits_q - logits_fp).abs().max().item()
    assert 1e-4 < diff < 0.05, diff


def test_sync_requantises_in_place_from_the_new_trainer_weights():
    """After the trainer's weights change, load_weights re-quantises: the int8 data keep their
    storage (compiled graphs stay valid), and greedy tokens and logprobs follow the new weights
    (equal to a fresh int8 generator of them), within int8 error of the full-precision model."""
    model = _trainer_model()
    gen = _generator(model, quantize="int8")
    wq = gen.model.layers["0"].attention.wq.weight
    ptr, before = wq.qdata.data_ptr(), wq.qdata.clone()
    prompts = _prompts([5, 11])
    params = SamplingParams(max_new_tokens=12, temperature=0)
    old, _ = gen.generate(prompts, params)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert not gen.share_weights(model)  # quantised: its own weights, never the trainer's storage
    gen.load_weights(model)
    assert wq.qdata.data_ptr() == ptr and not torch.equal(wq.qdata, before)
    new, _ = gen.generate(prompts, params)
    fresh, _ = _generator(model, quantize="int8").generate(prompts, params)
    assert [c.token_ids for c in new] == [c.token_ids for c in fresh] != [c.token_ids for c in old]
    for c, f in zip(new, fresh):
        assert c.logprobs == pytest.approx(f.logprobs, abs=1e-6)
        ref_tokens, ref_logprobs = greedy_reference(_int8_reference(model), prompts[c.prompt_index], 12)
        assert c.token_ids == ref_tokens and c.logprobs == pytest.approx(ref_logprobs, abs=1e-4)


def test_compiled_int8_decode_matches_eager_int8():
    """Greedy tokens of the compiled int8 decode step (aot_eager: the traced graph with the int8
    tensor subclass, no inductor codegen on the 2-core CI) equal eager int8's, also after a sync."""
    torch._dynamo.reset()
    model = _trainer_model()
    params = SamplingParams(max_new_tokens=10, temperature=0)
    prompts = _prompts([3, 9, 17])
    eager = _generator(model, quantize="int8")
    compiled = _generator(model, quantize="int8", compile=True, compile_backend="aot_eager")
    for _ in range(2):
        a, _ = eager.generate(prompts, params)
        b, _ = compiled.generate(prompts, params)
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        for x, y in zip(a, b):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
        with torch.no_grad():
            model.layers["0"].feed_forward.w2.weight.mul_(-1.0)
        eager.load_weights(model)
        compiled.load_weights(model)


def test_invalid_combinations_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="batch_invariant"):
        GeneratorConfig(quantize="int8", batch_invariant=True).validate()
    with pytest.raises(ValueError, match=r"needs a CUDA GPU with compute capability >= 8.9"):
        Generator(ARGS, GeneratorConfig(quantize="fp8", num_blocks=8), torch.device("cpu"))
    with pytest.raises(ValueError, match="tensor parallelism"):
        check_quantize_supported("int8", torch.device("cpu"), tp_degree=2)
    assert _generator(_trainer_model(), quantize="none").share_weights(_trainer_model())


def test_rl_step_with_int8_rollout_logs_the_mismatch_and_applies_tis(tmp_path):
    """Two GRPO steps with an int8 generator and TIS: sampler and trainer logprobs now differ
    (gen_logprob_diff > 0, mismatch_kl >= 0), the loss gets importance weights that are not all
    one, and losses and grad norms are finite."""
    from titanrl.train import build_trainer

    trainer = build_trainer(
        load_config(
            [
                f"--job.config_file={CONFIGS}/grpo_reverse_debug.toml",
                f"--job.dump_folder={tmp_path}",
                "--training.steps=2",
                "--sft_warmup.steps=0",
                "--training.batch_size=4",
                "--algorithm.group_size=4",
                "--generator.max_new_tokens=6",
                "--data.num_eval_samples=4",
                "--reward.num_workers=1",
                "--metrics.eval_freq=0",
                "--generator.quantize=int8",
                "--algorithm.off_policy_correction=tis",
            ]
        )
    )
    seen = []
    loss = trainer.recipe.algorithm.loss
    trainer.recipe.algorithm.loss = lambda inputs: seen.append((inputs.is_weights_BT, out := loss(inputs))) or out
    try:
        assert trainer.recipe.generator.quantizer is not None and not trainer.recipe.generator.shares_weights
        loader = iter(trainer.recipe.loader)
        metrics = [trainer.recipe.step(loader, step) for step in (1, 2)]
    finally:
        trainer.close()
    for m in metrics:
        assert m["gen_logprob_diff"] > 0 and m["mismatch_kl"] >= 0 and m["mismatch_ratio_max"] > 0
        assert "is_dropped_frac" in m and math.isfinite(m["grad_norm"]) and m["skipped_updates"] == 0
    assert all(w is not None and not torch.all(w == 1.0) for w, _ in seen)
    assert all(math.isfinite(out.loss.item()) for _, out in seen)


def test_int8_weight_memory_at_real_vocabulary():
    """Qwen2.5-0.5B widths (2 of its 24 blocks) at the real 151,936-token vocabulary: the int8
    generator stores each block projection in 1 byte per weight plus a float32 scale and an int8
    zero point per row; the tied embedding/head stays float32. Measured: 663.8 MB fp32 ->
    574.5 MB int8 (0.865x), the block projections 119.3 -> 29.9 MB (3.98x); with all 24 blocks
    (benchmarks/bench_quant_rollout.py, on the meta device) 1976.1 -> 904.2 MB (0.458x)."""
    args = TransformerModelArgs(
        family="qwen2",
        dim=896,
        n_layers=2,
        n_heads=14,
        n_kv_heads=2,
        hidden_dim=4864,
        vocab_size=151_936,
        qkv_bias=True,
        tie_word_embeddings=True,
        max_seq_len=64,
    )
    config = dict(block_size=16, num_blocks=4)
    fp32 = Generator(args, GeneratorConfig(**config), torch.device("cpu"))
    fp32_bytes = weight_bytes(fp32.model)
    projections = {
        n: p.shape
        for n, p in fp32.model.named_parameters()
        if n.endswith(".weight") and n.rsplit(".", 2)[-2] in BLOCK_PROJECTIONS
    }
    del fp32
    int8 = Generator(args, GeneratorConfig(quantize="int8", **config), torch.device("cpu"))
    int8_bytes = weight_bytes(int8.model)
    proj_fp32 = sum(r * c * 4 for r, c in projections.values())
    proj_int8 = sum(r * c + r * (4 + 1) for r, c in projections.values())
    assert int8_bytes == fp32_bytes - proj_fp32 + proj_int8
    assert proj_fp32 / proj_int8 > 3.9 and int8_bytes < 0.9 * fp32_bytes
    print(
        f"\nweights at vocab 151936: fp32 {fp32_bytes / 1e6:.1f} MB, int8 {int8_bytes / 1e6:.1f} MB "
        f"({int8_bytes / fp32_bytes:.3f}x); block projections {proj_fp32 / 1e6:.1f} -> {proj_int8 / 1e6:.1f} MB"
    )
    (c,), _ = int8.generate([[151644, 872, 198]], SamplingParams(max_new_tokens=2, temperature=0))
    assert len(c.token_ids) == 2
