"""Logprobs and entropy without [B, T, vocab] logits (`models/logprobs.py`) against the
full-logits float64 reference, values and gradients, at a toy and at the real vocabulary; on
1 rank and vocab-parallel on tp=2 (gloo ranks under torchrun)."""

import json
import os

import pytest
import torch
from helpers import background
from helpers.launch import REPO_ROOT
from helpers.tiny import tiny_model

from titanrl.models import TransformerModelArgs
from titanrl.models.logprobs import chunked_token_logprobs, token_logprobs


def _reference(h_BTD, w_VD, targets_BT):
    logp_BTV = torch.log_softmax(h_BTD.double() @ w_VD.double().t(), -1)
    return logp_BTV.gather(-1, targets_BT[..., None]).squeeze(-1), -(logp_BTV.exp() * logp_BTV).sum(-1)


def _errors(h, w, targets, weights_BT, compute) -> list[float]:
    """Max |difference| from the float64 reference of (logprobs, entropy, grad h, grad w)."""
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logprobs, entropy = compute(h, w)
    (logprobs.double() * weights_BT).sum().backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref_logprobs, ref_entropy = _reference(h64, w64, targets)
    (ref_logprobs * weights_BT).sum().backward()
    pairs = [(logprobs, ref_logprobs), (entropy, ref_entropy), (h.grad, h64.grad), (w.grad, w64.grad)]
    return [(a.double() - b.detach()).abs().max().item() for a, b in pairs]


@pytest.mark.parametrize("V,chunk", [(97, 5), (97, 1000), (151_936, 16)])
def test_values_and_gradients_match_the_full_logits_reference(V, chunk):
    """float64 inputs: logprobs, entropy and both gradients equal the float64 full-logits
    reference to 1e-10. float32 inputs: within 1e-6, or within what float32 itself costs — at
    most 4x the error of the plain float32 full-logits autograd path (at 151,936 tokens a float32
    sum over the vocabulary is off by ~3e-6 on its own, and the summation order, hence the
    error, changes with the number of BLAS threads)."""
    torch.manual_seed(0)
    B, T, D = 2, 11, 24
    h = 0.5 * torch.randn(B, T, D, dtype=torch.float64)
    w = 0.5 * torch.randn(V, D, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T))
    weights_BT = torch.randn(B, T, dtype=torch.float64)  # an arbitrary upstream gradient

    def chunked(h, w):
        return chunked_token_logprobs(h, w, targets, chunk, with_entropy=True)

    def full(h, w):
        logp = torch.log_softmax((h @ w.t()).float(), -1)
        return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    assert max(_errors(h, w, targets, weights_BT, chunked)) < 1e-10
    errors32 = _errors(h.float(), w.float(), targets, weights_BT, chunked)
    plain32 = _errors(h.float(), w.float(), targets, weights_BT, full)
    for what, err, plain in zip(["logprobs", "entropy", "grad h", "grad w"], errors32, plain32):
        assert err <= 1e-6 or err <= 4 * plain, (what, err, plain)
    _, entropy = chunked(h, w)
    assert not entropy.requires_grad


def test_model_logprobs_equal_logits_path_and_chunking_does_not_matter():
    """`Transformer.logprobs` (chunked) equals token_logprobs of the full logits to float32
    rounding, whatever the chunk size; its parameter gradients agree too."""
    args = TransformerModelArgs(
        family="qwen3",
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=48,
        vocab_size=300,
        qk_norm=True,
        tie_word_embeddings=True,
        max_seq_len=32,
    )
    model = tiny_model(args, 0)
    tokens = torch.randint(0, 300, (3, 17))
    full = token_logprobs(model(tokens[:, :-1]), tokens[:, 1:])
    full.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for chunk in (1, 7, 1000):
        model.zero_grad()
        chunked, _ = model.logprobs(tokens[:, :-1], tokens[:, 1:], chunk)
        torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)
        chunked.sum().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6)


def test_masked_positions_only_are_projected_and_match_the_unmasked_path():
    """With a mask (an RL batch's completion tokens), only the masked rows reach the output layer;
    their values and every gradient equal the unmasked path's restricted to the mask (float64:
    same ops per row), the other positions are 0, and an all-zero mask projects nothing."""
    torch.manual_seed(0)
    B, T, D, V = 3, 9, 16, 53
    h = torch.randn(B, T, D, dtype=torch.float64)
    w = torch.randn(V, D, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T))
    mask = torch.zeros(B, T)
    mask[0, 4:] = 1
    mask[2, 1:3] = 1
    upstream = torch.randn(B, T, dtype=torch.float64)
    results = []
    for m in (None, mask):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        logprobs, entropy = chunked_token_logprobs(hh, ww, targets, 4, with_entropy=True, mask_BT=m)
        (logprobs * upstream * mask).sum().backward()
        results.append((logprobs, entropy, hh.grad, ww.grad))
    (lp, ent, gh, gw), (lp_m, ent_m, gh_m, gw_m) = results
    torch.testing.assert_close(lp_m, lp * mask, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent_m, ent * mask, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gh_m, gh, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw_m, gw, rtol=1e-12, atol=1e-12)
    assert (gh_m.abs().sum(-1) > 0).eq(mask.bool()).all()  # unmasked rows get no gradient

    projected = []
    linear = torch.nn.functional.linear
    try:
        torch.nn.functional.linear = lambda x, weight: projected.append(len(x)) or linear(x, weight)
        chunked_token_logprobs(h, w, targets, 4, mask_BT=mask)
        chunked_token_logprobs(h, w, targets, 4, mask_BT=torch.zeros(B, T))
    finally:
        torch.nn.functional.linear = linear
    assert sum(projected) == int(mask.sum())


# In the background from collection on (helpers/background.py).
background.register_torchrun(
    "logprobs_tp",
    ("tests/test_logprobs.py::test_tp2_",),
    os.path.join(REPO_ROOT, "tests", "multirank", "logprobs_tp_worker.py"),
    2,
    lambda folder: ["--out", f"{folder}/results.json"],
)


@pytest.fixture(scope="module")
def tp2_results():
    """One torchrun launch (2 ranks) runs every tp check; see tests/multirank/logprobs_tp_worker.py."""
    with open(os.path.join(background.torchrun_result("logprobs_tp"), "results.json")) as f:
        return json.load(f)


@pytest.mark.multirank
def test_tp2_vocab_parallel_values_and_gradients_match_the_full_logits_reference(tp2_results):
    """Vocab shards (Shard(0)) on 2 ranks, h sequence-sharded (also replicated or plain), with
    and without a mask, chunk 1 / 5 / > N, vocabulary 194 and 151,936: logprobs, entropy, grad h and
    grad W (gathered) equal the float64 full-logits reference to 1e-10 (float32 inputs: 5e-6);
    an all-zero mask gives zeros and zero gradients."""
    cases = {k: v for k, v in tp2_results.items() if k.startswith("V")}
    assert len(cases) == 2 * 6 + 1, list(cases)
    for case, errors in cases.items():
        bound = 5e-6 if case.endswith("float32") else 1e-10
        assert max(errors.values()) < bound, (case, errors)
    assert tp2_results["empty_mask_ok"]


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_tp2_model_logprobs_match_one_rank_without_gathering_logits(tp2_results, family):
    """A float64 Transformer under `apply_tp` (sequence parallel; qwen3: tied embeddings, qwen2:
    untied): `model.logprobs` values, entropy and every parameter gradient equal its 1-rank copy's
    to 1e-12, with `model.output` disabled and no op producing a tensor whose last dim is the
    vocabulary (a detector that does see the gathered logits of `model(tokens)`)."""
    results = tp2_results[f"model/{family}"]
    assert results.pop("detector_sees_gathered_logits")
    assert len(results) == 2
    for case, errors in results.items():
        assert max(errors.values()) < 1e-12, (case, errors)
