"""Batch-invariant mode, op by op: a row's bits do not depend on its batch (size, position,
neighbours), decode-style attention equals full-sequence attention bit for bit, and both stay
within float rounding of a float64 reference. The end-to-end parity (generator vs trainer
logprobs) is tested in test_generator.py, test_trainer.py and test_train.py."""

import pytest
import torch
import torch.nn.functional as F
from helpers.tiny import tiny_model, tiny_model_args

from titanrl.models.batch_invariant import (
    KEY_BLOCK,
    TILE_ROWS,
    ExactCausalAttention,
    attend_exact,
    attend_exact_batched,
    attend_exact_spans,
    batch_invariant_mode,
)
from titanrl.models.model import RMSNorm

DTYPES = [torch.float32, torch.bfloat16]
# (in, out) of the debug and Qwen2.5-0.5B layers, plus dimensions that are not multiples of 8.
LINEAR_SHAPES = [(256, 768), (768, 256), (256, 128), (256, 264), (896, 4864), (100, 37), (64, 30)]
ROW_COUNTS = [1, 2, 3, 5, TILE_ROWS - 1, TILE_ROWS, TILE_ROWS + 1, 3 * TILE_ROWS + 7, 70]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_linear_row_is_bitwise_the_same_in_any_batch(shape, dtype):
    """A row's F.linear output (mm, and addmm with a bias) alone equals the same row at the
    start, middle and end of batches of every size, among random neighbours, and in a 3-D batch."""
    K, N = shape
    g = torch.Generator().manual_seed(K * N)
    W = torch.randn(N, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype)
    x = torch.randn(K, generator=g).to(dtype)
    with batch_invariant_mode():
        alone, alone_b = F.linear(x[None], W)[0], F.linear(x[None], W, bias)[0]
        for M in ROW_COUNTS:
            for p in {0, M // 2, M - 1}:
                A = torch.randn(M, K, generator=g).to(dtype)
                A[p] = x
                assert torch.equal(F.linear(A, W)[p], alone), (M, p)
                assert torch.equal(F.linear(A, W, bias)[p], alone_b), (M, p)
        A = torch.randn(3, 7, K, generator=g).to(dtype)
        A[2, 5] = x
        assert torch.equal(F.linear(A, W)[2, 5], alone)
    ref = x.double() @ W.double().t()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(alone.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_linear_is_the_same_with_one_or_two_threads():
    """Generator and trainer share a process and its thread count; the tiles do not depend on it
    anyway (checked so that a thread-count change is not a silent source of mismatch)."""
    g = torch.Generator().manual_seed(0)
    W, A = torch.randn(768, 256, generator=g), torch.randn(40, 256, generator=g)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with batch_invariant_mode():
                outs.append(F.linear(A, W))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_rmsnorm_row_is_bitwise_the_same_in_any_batch():
    g = torch.Generator().manual_seed(0)
    for dim, lead in [(256, [(1,), (7,), (300,)]), (64, [(1, 1, 4), (5, 9, 4), (2, 100, 14)])]:
        norm = RMSNorm(dim, 1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(dim, generator=g))
        x = torch.randn(dim, generator=g)
        alone = norm(x.view(*[1] * len(lead[0]), dim)).flatten()
        for shape in lead:
            X = torch.randn(*shape, dim, generator=g)
            X.view(-1, dim)[-1] = x
            assert torch.equal(norm(X).view(-1, dim)[-1], alone), shape


def _reference_attention(q_THD, k_THD, v_THD):
    """Causal attention in float64."""
    n_rep = q_THD.shape[1] // k_THD.shape[1]
    k_THD, v_THD = k_THD.repeat_interleave(n_rep, 1), v_THD.repeat_interleave(n_rep, 1)
    q, k, v = (t.double().transpose(0, 1) for t in (q_THD, k_THD, v_THD))
    T = q.shape[1]
    scores = (q @ k.transpose(1, 2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_decode_equals_full_sequence_bitwise(dtype):
    """Sequences of different lengths (over several key blocks), right-padded in one batch as the
    trainer sees them; each query's output equals, bit for bit: decoding it alone over its cached
    keys, decoding it among other sequences with other context lengths, and a prefill chunk.
    All of them are within rounding of float64 attention."""
    g = torch.Generator().manual_seed(1)
    H, Hkv, D = 4, 2, 32
    lengths = [1, 5, KEY_BLOCK, KEY_BLOCK + 3, 2 * KEY_BLOCK + 17]
    T = max(lengths)
    q, k, v = (torch.randn(len(lengths), T, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv))
    full = ExactCausalAttention().attend(0, q, k, v)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for b, L in enumerate(lengths):
        # Trainer batch vs this sequence alone, padded differently.
        alone = ExactCausalAttention().attend(0, q[b : b + 1, :L], k[b : b + 1, :L], v[b : b + 1, :L])[0]
        assert torch.equal(alone, full[b, :L])
        for p in sorted({0, L // 2, L - 1, min(L - 1, KEY_BLOCK - 1), min(L - 1, KEY_BLOCK)}):
            assert torch.equal(attend_exact(q[b, p : p + 1], k[b, : p + 1], v[b, : p + 1], [p])[0], full[b, p]), (b, p)
        start = L // 3  # a prefill chunk of queries start..L-1 over the cache 0..L-1
        chunk = attend_exact(q[b, start:L], k[b, :L], v[b, :L], list(range(start, L)))
        assert torch.equal(chunk, full[b, start:L])
        ref = _reference_attention(q[b, :L], k[b, :L], v[b, :L])
        torch.testing.assert_close(full[b, :L].double(), ref, rtol=tol, atol=tol)
    # One decode step of all sequences together: each at its last position; keys past a
    # sequence's context hold other data (as a paged gather does) and must not matter.
    pos_S1 = torch.tensor(lengths).unsqueeze(1) - 1
    q_S1HD = q[torch.arange(len(lengths)), pos_S1[:, 0]].unsqueeze(1)
    step = attend_exact_batched(q_S1HD, k, v, pos_S1)
    for b, L in enumerate(lengths):
        assert torch.equal(step[b, 0], full[b, L - 1]), b
    garbage = torch.randn(k.shape, generator=g).to(dtype)
    k2, v2 = k.clone(), v.clone()
    for b, L in enumerate(lengths):
        k2[b, L:], v2[b, L:] = garbage[b, L:], garbage[b, L:]
    assert torch.equal(attend_exact_batched(q_S1HD, k2, v2, pos_S1), step)


def test_exact_attention_gradient_is_ordinary_attention_gradient():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 9, h, 16, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    grad = torch.randn(2, 9, 4, 16, generator=g, dtype=torch.float64)
    exact = torch.autograd.grad(ExactCausalAttention().attend(0, q, k, v), (q, k, v), grad)
    plain = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    for a, b in zip(exact, torch.autograd.grad(plain, (q, k, v), grad)):
        torch.testing.assert_close(a, b)


def test_model_logits_of_a_sequence_do_not_depend_on_its_batch():
    """The whole model under the mode: a sequence's logits alone equal its logits in a right-padded
    batch of sequences of other lengths, and its last position's logits equal those of a decode
    step over its prefix (positions given, attention over the cache)."""
    args = tiny_model_args(vocab_size=50, max_seq_len=128)
    model = tiny_model(args, 0)
    tokens = torch.randint(0, 50, (5, 70))

    class Decode:
        def __init__(self, k_cache, v_cache, pos):
            self.k_cache, self.v_cache, self.pos = k_cache, v_cache, pos

        def attend(self, layer_id, q_1NHD, k_1NHD, v_1NHD):
            # The prefix's keys from the full forward, this token's own from this step.
            k = torch.cat([self.k_cache[layer_id], k_1NHD[0]])
            v = torch.cat([self.v_cache[layer_id], v_1NHD[0]])
            return attend_exact(q_1NHD[0], k, v, [self.pos]).unsqueeze(0)

    with torch.no_grad(), batch_invariant_mode():
        batch = model(tokens, backend=ExactCausalAttention())
        L = 33
        alone = model(tokens[3:4, :L], backend=ExactCausalAttention())[0]
        assert torch.equal(alone, batch[3, :L])
        # k/v of the prefix, captured from a forward of the prefix.
        cache_k, cache_v = {}, {}

        class Capture(ExactCausalAttention):
            def attend(self, layer_id, q, k, v):
                cache_k[layer_id], cache_v[layer_id] = k[0], v[0]
                return super().attend(layer_id, q, k, v)

        model(tokens[3:4, : L - 1], backend=Capture())
        step = model(tokens[3:4, L - 1 : L], torch.tensor([[L - 1]]), Decode(cache_k, cache_v, L - 1))[0, 0]
        assert torch.equal(step, batch[3, L - 1])


def test_packed_documents_get_the_bits_of_their_padded_rows():
    """`attend_exact_spans` over packed rows (documents concatenated, positions restarting at 0)
    equals exact attention over each document in its own padded row, bit for bit; gradients
    equal those of the per-document computation."""
    g = torch.Generator().manual_seed(3)
    spans = [[(0, 5), (5, 12), (12, 20)], [(0, 20)], [(0, 1), (1, 19), (19, 20)]]
    q, k, v = (torch.randn(3, 20, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    w = torch.randn(3, 20, 4, 16, generator=g)
    packed = attend_exact_spans(q, k, v, spans)
    rows = []
    for r, row in enumerate(spans):
        docs = [
            ExactCausalAttention().attend(0, q[r : r + 1, a:b], k[r : r + 1, a:b], v[r : r + 1, a:b])[0] for a, b in row
        ]
        for (a, b), alone in zip(row, docs):
            assert torch.equal(packed[r, a:b], alone), (r, a, b)
        rows.append(torch.cat(docs))
    grads = torch.autograd.grad((packed * w).sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad((torch.stack(rows) * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b)
