"""Model unit tests: flavors, float64 reference numerics, activation checkpointing, compile."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.tiny import tiny_model, tiny_model_args

from titanrl.distributed.parallelize import apply_ac, apply_compile
from titanrl.models import Transformer, flavors, get_model_args

TINY = tiny_model_args(tie_word_embeddings=False, n_layers=3, max_seq_len=64)


def _model(args=TINY, seed=0) -> Transformer:
    model = tiny_model(args, seed)
    return model


# Published parameter counts (embeddings included), in millions.
PUBLISHED_PARAMS_M = {
    "qwen2.5-0.5b": 494,
    "qwen2.5-1.5b": 1544,
    "qwen2.5-7b": 7616,
    "qwen3-0.6b": 596,
    "qwen3-1.7b": 1721,
    "qwen3-8b": 8191,
    "llama3.2-1b": 1236,
    "llama3.1-8b": 8030,
}


@pytest.mark.parametrize("flavor", sorted(PUBLISHED_PARAMS_M))
def test_flavor_param_counts(flavor):
    with torch.device("meta"):
        model = Transformer(get_model_args(flavor))
    n = sum(p.numel() for p in model.parameters())
    assert abs(n / 1e6 - PUBLISHED_PARAMS_M[flavor]) < 1.0


@pytest.mark.parametrize("flavor, low, high", [("debug", 1e6, 10e6), ("debug-large", 8e6, 15e6)])
def test_debug_flavors_are_small_and_fit_byte_tokenizer(flavor, low, high):
    from titanrl.models.tokenizer import ByteTokenizer

    args = flavors[flavor]
    with torch.device("meta"):
        n = sum(p.numel() for p in Transformer(args).parameters())
    assert low < n < high
    assert args.vocab_size >= ByteTokenizer().vocab_size


def test_unknown_flavor_suggests():
    with pytest.raises(ValueError, match="Did you mean 'qwen3-0.6b'"):
        get_model_args("qwen3-0.6")


def _reference_forward_f64(model: Transformer, tokens_BT: torch.Tensor) -> torch.Tensor:
    """Independent float64 re-implementation: explicit attention matrix, repeat_interleave GQA."""
    a = model.args
    sd = {k: v.double() for k, v in model.state_dict().items()}
    T = tokens_BT.shape[1]

    def rms(x, w):
        return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + a.norm_eps))

    inv = 1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.float64) / a.head_dim))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = torch.cos(ang), torch.sin(ang)

    def rope(x):  # [B, T, H, D], halves layout
        x1, x2 = x[..., : a.head_dim // 2], x[..., a.head_dim // 2 :]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    h = sd["tok_embeddings.weight"][tokens_BT]
    B = tokens_BT.shape[0]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(a.n_layers):
        p = f"layers.{i}."
        x = rms(h, sd[p + "attention_norm.weight"])
        q = (x @ sd[p + "attention.wq.weight"].T).view(B, T, a.n_heads, a.head_dim)
        k = (x @ sd[p + "attention.wk.weight"].T).view(B, T, a.n_kv_heads, a.head_dim)
        v = (x @ sd[p + "attention.wv.weight"].T).view(B, T, a.n_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = rms(q, sd[p + "attention.q_norm.weight"]), rms(k, sd[p + "attention.k_norm.weight"])
        q, k = rope(q), rope(k)
        rep = a.n_heads // a.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bthd,bshd->bhts", q, k) / a.head_dim**0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        attn = torch.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, -1)
        h = h + attn @ sd[p + "attention.wo.weight"].T
        x = rms(h, sd[p + "ffn_norm.weight"])
        gate, up = x @ sd[p + "feed_forward.w1.weight"].T, x @ sd[p + "feed_forward.w3.weight"].T
        h = h + (F.silu(gate) * up) @ sd[p + "feed_forward.w2.weight"].T
    return rms(h, sd["norm.weight"]) @ sd["output.weight"].T


def test_forward_matches_float64_reference():
    model = _model()
    # Perturb norms so that their weights matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    tokens_BT = torch.randint(0, TINY.vocab_size, (2, 33))
    ref = _reference_forward_f64(model, tokens_BT)
    with torch.no_grad():
        ours = model(tokens_BT).double()
    assert (ours - ref).abs().max().item() < 1e-4
    # In float64 only the float32 RoPE table (kept in float32 by design, as in HF) differs.
    model64 = copy.deepcopy(model).double()
    with torch.no_grad():
        assert (model64(tokens_BT) - ref).abs().max().item() < 1e-6


def test_causality_and_positions():
    model = _model()
    tokens_BT = torch.randint(0, TINY.vocab_size, (1, 20))
    with torch.no_grad():
        full = model(tokens_BT)
        prefix = model(tokens_BT[:, :12])
        # Explicit positions equal to the defaults change nothing; RoPE is relative, so a uniform
        # shift changes (almost) nothing either, while a gap in the positions does.
        same = model(tokens_BT, torch.arange(20)[None])
        shifted = model(tokens_BT, torch.arange(20)[None] + 3)
        gapped = model(tokens_BT, torch.cat([torch.arange(10), torch.arange(10) + 15])[None])
    assert torch.allclose(full[:, :12], prefix, atol=1e-5)
    assert torch.equal(full, same)
    assert torch.allclose(full, shifted, atol=1e-4)
    assert torch.allclose(full[:, :10], gapped[:, :10], atol=1e-5)
    assert not torch.allclose(full[:, 10:], gapped[:, 10:], atol=1e-3)


def test_too_long_sequence_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len 64"):
        _model()(torch.zeros(1, 65, dtype=torch.long))


def _loss_and_grads(model: Transformer, tokens_BT: torch.Tensor):
    model.zero_grad()
    logits = model(tokens_BT[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens_BT[:, 1:].reshape(-1))
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    return loss.item(), grads


@pytest.mark.parametrize("mode,option", [("full", "op"), ("selective", "op"), ("selective", "2")])
def test_activation_checkpointing_same_gradients(mode, option):
    tokens_BT = torch.randint(0, TINY.vocab_size, (2, 24))
    base = _model()
    ac = copy.deepcopy(base)
    apply_ac(ac, mode, option)
    wrapped = [n for n, _ in ac.layers.named_children() if "Checkpoint" in type(ac.layers[n]).__name__]
    assert wrapped == (["1"] if option == "2" else ["0", "1", "2"])
    loss_ref, grads_ref = _loss_and_grads(base, tokens_BT)
    loss_ac, grads_ac = _loss_and_grads(ac, tokens_BT)
    assert loss_ac == loss_ref
    assert grads_ac.keys() == grads_ref.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads_ac[name], grads_ref[name], rtol=0, atol=1e-6)
    # Wrapping keeps checkpoint-facing names.
    assert ac.state_dict().keys() == base.state_dict().keys()


def test_compile_matches_eager():
    """Per-block inductor compile: same logits and gradients within fp32 tolerance, same names."""
    tokens_BT = torch.randint(0, TINY.vocab_size, (2, 24))
    eager = _model()
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, backend="inductor")
    loss_e, grads_e = _loss_and_grads(eager, tokens_BT)
    loss_c, grads_c = _loss_and_grads(compiled, tokens_BT)
    with torch.no_grad():
        logits_diff = (compiled(tokens_BT) - eager(tokens_BT)).abs().max().item()
    assert logits_diff < 1e-4
    assert loss_c == pytest.approx(loss_e, abs=1e-5)
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-5)
    assert compiled.state_dict().keys() == eager.state_dict().keys()
