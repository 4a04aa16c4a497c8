"""Mixture of experts: transformers Qwen3-MoE parity (logits, greedy generations through the paged
generator, export), grouped experts against a float64 per-expert loop, the load-balancing loss,
the auxiliary-loss-free bias update and routing replay."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from titanrl.config.generation import Generator as GeneratorConfig  # noqa: E402
from titanrl.generator import Generator, SamplingParams  # noqa: E402
from titanrl.models import Transformer, TransformerModelArgs, get_model_args  # noqa: E402
from titanrl.models.hf import export_hf, load_hf_weights, read_hf_config  # noqa: E402
from titanrl.models.moe import MoE, grouped_mm_supported  # noqa: E402

TOL = 1e-5  # max |logit diff| allowed in fp32


def _tiny_hf_moe(norm_topk_prob: bool, sparse_step: int, mlp_only: list[int]):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=sparse_step,
        mlp_only_layers=mlp_only,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))  # decisive routing: a wrong expert changes the logits
            elif ".experts." in name:
                p.copy_(0.1 * torch.randn_like(p))  # experts that differ from each other
    return model.eval()


def _titan_from_folder(folder) -> Transformer:
    with torch.device("meta"):
        model = Transformer(read_hf_config(str(folder)))
    model.to_empty(device="cpu")
    model.init_weights()
    load_hf_weights(model, str(folder))
    return model.eval()


@pytest.mark.parametrize("norm_topk_prob,sparse_step,mlp_only", [(True, 1, [1]), (False, 2, [])])
def test_hf_qwen3_moe_logits_and_export(tmp_path, norm_topk_prob, sparse_step, mlp_only):
    hf_model = _tiny_hf_moe(norm_topk_prob, sparse_step, mlp_only)
    hf_model.save_pretrained(tmp_path / "hf")
    model = _titan_from_folder(tmp_path / "hf")
    moe_layers = [i for i in range(4) if i not in mlp_only and (i + 1) % sparse_step == 0]
    assert [i for i, b in model.layers.items() if b.moe is not None] == [str(i) for i in moe_layers]
    tokens_BT = torch.randint(0, 97, (3, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(input_ids=tokens_BT).logits
        ours = model(tokens_BT)
    assert (ours - ref).abs().max().item() < TOL
    assert model.moe_routes().shape == (len(moe_layers), 3 * 37, 2)

    export_hf(model, str(tmp_path / "export"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    assert type(reloaded) is type(hf_model)
    with torch.no_grad():
        assert (reloaded(input_ids=tokens_BT).logits - ref).abs().max().item() < TOL


@pytest.mark.parametrize("attention_impl", ["auto", "exact"])
def test_paged_generator_greedy_matches_transformers_generate(tmp_path, attention_impl):
    hf_model = _tiny_hf_moe(True, 1, [1])
    hf_model.save_pretrained(tmp_path / "hf")
    args = read_hf_config(str(tmp_path / "hf"))
    gen = Generator(
        args, GeneratorConfig(block_size=4, num_blocks=256, attention_impl=attention_impl), torch.device("cpu")
    )
    gen.load_hf(str(tmp_path / "hf"))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (1, 3, 5, 8, 9, 13, 17, 21, 30, 4, 11, 25)]
    completions, _ = gen.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
    for prompt, completion in zip(prompts, completions, strict=True):
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert completion.token_ids == out[0, len(prompt) :].tolist()


def _moe(dtype=torch.float64, expert_bias=False, norm_topk_prob=True, seed=0) -> MoE:
    args = TransformerModelArgs(
        dim=16,
        n_heads=2,
        n_kv_heads=2,
        hidden_dim=24,
        moe_num_experts=8,
        moe_top_k=2,
        moe_intermediate_size=12,
        moe_norm_topk_prob=norm_topk_prob,
        moe_expert_bias=expert_bias,
    )
    torch.manual_seed(seed)
    moe = MoE(args)
    moe.init_weights(0.02, torch.device("cpu"))
    with torch.no_grad():
        moe.router.gate.weight.normal_()
        for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
            w.normal_(std=0.3)
    return moe.to(dtype)


def _reference_moe(moe: MoE, x_TD: torch.Tensor, routes_TK: torch.Tensor) -> torch.Tensor:
    """Token by token, slot by slot: the router's renormalised probability times the expert."""
    probs_TE = torch.softmax(x_TD @ moe.router.gate.weight.T, dim=-1)
    out = []
    for t in range(x_TD.shape[0]):
        w_K = probs_TE[t, routes_TK[t]]
        w_K = w_K / w_K.sum() if moe.router.norm_topk_prob else w_K
        acc = torch.zeros_like(x_TD[t])
        for k, e in enumerate(routes_TK[t].tolist()):
            h = torch.nn.functional.silu(moe.experts.w1[e] @ x_TD[t]) * (moe.experts.w3[e] @ x_TD[t])
            acc = acc + w_K[k] * (moe.experts.w2[e] @ h)
        out.append(acc)
    return torch.stack(out)


def _grads(moe: MoE, x: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(x.sum(), [x, moe.router.gate.weight, *moe.experts.parameters()]))


def test_grouped_experts_match_per_expert_loop_in_float64():
    moe = _moe()
    x_TD = torch.randn(11, 16, dtype=torch.float64, requires_grad=True)
    # Experts 5, 6 and 7 get no token; expert 0 most of them.
    routes_TK = torch.tensor([[0, 1], [1, 0], [0, 2], [3, 0], [2, 4]] * 2 + [[4, 3]])
    assert not grouped_mm_supported(x_TD)  # float64 takes the loop over experts
    ours = moe(x_TD.unsqueeze(0), routes_TK)[0]
    ref = _reference_moe(moe, x_TD, routes_TK)
    assert torch.equal(moe.routes_TK, routes_TK)
    assert (ours - ref).abs().max().item() < 1e-12
    g_ours = torch.autograd.grad((ours * ref.detach()).sum(), [x_TD, moe.router.gate.weight, *moe.experts.parameters()])
    g_ref = torch.autograd.grad((ref * ref.detach()).sum(), [x_TD, moe.router.gate.weight, *moe.experts.parameters()])
    for a, b in zip(g_ours, g_ref, strict=True):
        assert (a - b).abs().max().item() < 1e-12
    assert g_ours[2][5:].abs().max() == 0 and g_ours[2][:5].abs().min(dim=-1).values.sum() > 0


def test_router_choice_matches_reference_in_float64():
    moe = _moe()
    x_TD = torch.randn(40, 16, dtype=torch.float64)
    out = moe(x_TD.unsqueeze(0))[0]
    probs_TE = torch.softmax(x_TD @ moe.router.gate.weight.T, dim=-1)
    routes_TK = probs_TE.topk(2, dim=-1).indices
    assert torch.equal(moe.routes_TK, routes_TK)
    assert (out - _reference_moe(moe, x_TD, routes_TK)).abs().max().item() < 1e-12


@pytest.mark.parametrize(
    "device,dtype,tol",
    [
        ("cpu", torch.float32, 1e-5),
        pytest.param(
            "cuda",
            torch.bfloat16,
            3e-2,
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._grouped_mm bf16 needs a GPU"),
        ),
    ],
)
def test_grouped_mm_path_matches_loop(device, dtype, tol):
    experts = _moe(torch.float32).experts.to(device=device, dtype=dtype)
    x_SD = torch.randn(24, 16, device=device, dtype=dtype, requires_grad=True)
    if not grouped_mm_supported(x_SD):
        pytest.skip(f"torch._grouped_mm does not run on {device} {dtype} in this build")
    counts_E = torch.tensor([5, 0, 7, 0, 0, 9, 3, 0], device=device)  # empty experts included
    grad_SD = torch.randn(24, 16, device=device, dtype=dtype)
    outs = []
    for forward in (experts.forward_grouped, experts.forward_loop):
        y = forward(x_SD, counts_E)
        outs.append([y, *torch.autograd.grad(y, [x_SD, *experts.parameters()], grad_SD)])
    for a, b in zip(*outs, strict=True):
        assert (a.float() - b.float()).abs().max().item() < tol * max(1.0, b.float().abs().max().item())


def test_load_balancing_loss_matches_float64_reference_and_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    moe = _moe(torch.float32)
    x_TD = torch.randn(50, 16)
    moe(x_TD.unsqueeze(0))
    logits_TE = (x_TD.double() @ moe.router.gate.weight.double().T).detach()
    probs_TE = torch.softmax(logits_TE, dim=-1)
    f_E = torch.bincount(probs_TE.topk(2, dim=-1).indices.flatten(), minlength=8).double() / 50
    ref = 8 * (f_E * probs_TE.mean(dim=0)).sum()
    assert abs(moe.aux_loss.item() - ref.item()) < 1e-6
    hf = load_balancing_loss_func((logits_TE.float(),), num_experts=8, top_k=2)
    assert abs(moe.aux_loss.item() - hf.item()) < 1e-6
    (grad,) = torch.autograd.grad(moe.aux_loss, moe.router.gate.weight)
    assert grad.abs().sum() > 0  # the loss trains the router


def test_model_aux_loss_is_the_mean_over_moe_layers():
    torch.manual_seed(0)
    model = Transformer(get_model_args("debug-moe"))
    model.init_weights()
    model(torch.randint(0, 264, (2, 9)))
    layers = model.moe_layers()
    assert len(layers) == 3 and model.moe_routes().shape == (3, 18, 2)
    assert torch.allclose(model.moe_aux_loss(), torch.stack([m.aux_loss for m in layers]).mean())
    assert all(m.tokens_per_expert.sum().item() == 18 * 2 for m in layers)


def test_expert_bias_update_matches_float64_reference():
    moe = _moe(torch.float32, expert_bias=True)
    assert "expert_bias" in moe.state_dict() and "expert_bias" not in _moe(torch.float32).state_dict()
    bias_ref = torch.zeros(8, dtype=torch.float64)
    loads = torch.zeros(8, dtype=torch.float64)
    for _update in range(3):
        x_TD = torch.randn(30, 16)
        for _forward in range(2):  # loads accumulate over forwards until the update
            moe(x_TD.unsqueeze(0))
            scores_TE = torch.softmax(x_TD.double() @ moe.router.gate.weight.double().T, dim=-1) + bias_ref
            routes_TK = scores_TE.topk(2, dim=-1).indices
            assert torch.equal(moe.routes_TK, routes_TK)
            loads += torch.bincount(routes_TK.flatten(), minlength=8).double()
        assert torch.equal(moe.tokens_per_expert.double(), loads)
        moe.update_expert_bias(0.05)
        bias_ref += 0.05 * torch.sign(loads.mean() - loads)
        loads.zero_()
        assert (moe.expert_bias.double() - bias_ref).abs().max().item() < 1e-6
        assert moe.tokens_per_expert.sum() == 0


def test_expert_bias_chooses_but_does_not_weigh():
    moe = _moe(torch.float64, expert_bias=True)
    with torch.no_grad():
        moe.expert_bias[6] = 10.0  # every token picks expert 6 ...
    x_TD = torch.randn(7, 16, dtype=torch.float64)
    out = moe(x_TD.unsqueeze(0))[0]
    assert (moe.routes_TK[:, 0] == 6).all()
    # ... with the router's own probabilities as weights.
    assert (out - _reference_moe(moe, x_TD, moe.routes_TK)).abs().max().item() < 1e-12


def test_routes_replay_uses_the_recorded_experts_and_trains_the_router():
    torch.manual_seed(0)
    model = Transformer(get_model_args("debug-moe")).double()
    model.init_weights()
    tokens_BT = torch.randint(0, 264, (2, 13))
    logits = model(tokens_BT)
    routes_LTK = model.moe_routes()
    assert torch.equal(model(tokens_BT, routes_LTK=routes_LTK), logits)
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.router.gate.weight.normal_()  # the router now prefers other experts
    model(tokens_BT)
    assert not torch.equal(model.moe_routes(), routes_LTK)
    replayed = model(tokens_BT, routes_LTK=routes_LTK)
    assert torch.equal(model.moe_routes(), routes_LTK)
    gate = model.moe_layers()[0].router.gate.weight
    (grad,) = torch.autograd.grad(replayed.square().mean(), gate)
    assert grad.abs().sum() > 0
    with pytest.raises(ValueError, match="MoE layers"):
        model(tokens_BT, routes_LTK=routes_LTK[:2])


def test_dense_layers_have_no_moe_and_flavors_match_published_sizes():
    with torch.device("meta"):
        model = Transformer(get_model_args("qwen3-30b-a3b"))
        dense_twin = Transformer(get_model_args("debug"))
        debug_moe = Transformer(get_model_args("debug-moe"))

    def total_and_active(m: Transformer) -> tuple[float, float]:
        total = sum(p.numel() for p in m.parameters())
        routed = sum(p.numel() for n, p in m.named_parameters() if ".moe.experts." in n)
        return total, total - routed + routed * m.args.moe_top_k / max(m.args.moe_num_experts, 1)

    total, active = total_and_active(model)
    assert abs(total / 1e9 - 30.5) < 0.1 and abs(active / 1e9 - 3.3) < 0.1  # published: 30.5B / 3.3B
    assert len(model.moe_layers()) == 48 and all(b.feed_forward is None for b in model.layers.values())
    # The debug MoE has the active parameters of the dense debug model.
    assert abs(total_and_active(debug_moe)[1] / total_and_active(dense_twin)[1] - 1) < 0.01
    assert dense_twin.moe_layers() == [] and debug_moe.layers["3"].moe is None
