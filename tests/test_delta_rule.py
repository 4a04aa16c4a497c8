"""The gated delta rule kernels (`models/delta_rule.py`) against a naive float64 recurrence."""

import pytest
import torch
import torch.nn.functional as F

from titanrl.models.delta_rule import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation, which on a shared,
    loaded CPU costs more than the work (the file runs several times faster on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def naive_rule(q, k, v, g, beta, state=None):
    """One sequence [T, H, D] in float64, straight from the definition."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    T, H, K = k.shape
    S = torch.zeros(H, K, v.shape[-1], dtype=torch.float64) if state is None else state.double().clone()
    outs = []
    for t in range(T):
        for h in range(H):
            S[h] = S[h] * g[t, h].exp()
            u = beta[t, h] * (v[t, h] - S[h].T @ k[t, h])
            S[h] = S[h] + torch.outer(k[t, h], u)
        outs.append(torch.einsum("hkv,hk->hv", S, q[t] * K**-0.5))
    return torch.stack(outs), S


def random_inputs(B, T, H, K, V, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, K, generator=gen, dtype=dtype))
    k = l2norm(torch.randn(B, T, H, K, generator=gen, dtype=dtype))
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    # HF's gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
    g = -torch.rand(H, generator=gen, dtype=dtype).mul(4).exp() * F.softplus(
        torch.randn(B, T, H, generator=gen, dtype=dtype)
    )
    beta = torch.randn(B, T, H, generator=gen, dtype=dtype).sigmoid()
    return q, k, v, g, beta


@pytest.mark.parametrize("T", [1, 63, 64, 65, 150])
def test_chunked_equals_naive_float64(T):
    q, k, v, g, beta = random_inputs(2, T, 3, 8, 6)
    state0 = torch.randn(2, 3, 8, 6, dtype=torch.float64)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, state0)
    for b in range(2):
        ref_out, ref_state = naive_rule(q[b], k[b], v[b], g[b], beta[b], state0[b])
        torch.testing.assert_close(out[b], ref_out, atol=1e-6, rtol=0)
        torch.testing.assert_close(state[b], ref_state, atol=1e-6, rtol=0)


def test_ragged_rows_padded_with_inert_tokens():
    """Rows of lengths 5, 70 and 130 right-padded to 130 with beta = g = 0: each row's outputs
    and final state are its own sequence's."""
    lengths = [5, 70, 130]
    q, k, v, g, beta = random_inputs(3, 130, 2, 8, 4, seed=1)
    valid_BT = torch.arange(130)[None, :] < torch.tensor(lengths)[:, None]
    g, beta = g * valid_BT[..., None], beta * valid_BT[..., None]
    out, state = chunk_gated_delta_rule(q, k, v, g, beta)
    for b, n in enumerate(lengths):
        ref_out, ref_state = naive_rule(q[b, :n], k[b, :n], v[b, :n], g[b, :n], beta[b, :n])
        torch.testing.assert_close(out[b, :n], ref_out, atol=1e-6, rtol=0)
        torch.testing.assert_close(state[b], ref_state, atol=1e-6, rtol=0)


def test_recurrent_equals_naive_and_chains():
    q, k, v, g, beta = random_inputs(2, 20, 2, 8, 4, seed=2)
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta)
    for b in range(2):
        ref_out, ref_state = naive_rule(q[b], k[b], v[b], g[b], beta[b])
        torch.testing.assert_close(out[b], ref_out, atol=1e-10, rtol=0)
        torch.testing.assert_close(state[b], ref_state, atol=1e-10, rtol=0)
    # Prefill of 12 chunked, then 8 one-token steps carrying the state: the same outputs.
    head, tail = chunk_gated_delta_rule(q[:, :12], k[:, :12], v[:, :12], g[:, :12], beta[:, :12])
    outs = [head]
    for t in range(12, 20):
        o, tail = recurrent_gated_delta_rule(*(x[:, t : t + 1] for x in (q, k, v, g, beta)), tail)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), out, atol=1e-10, rtol=0)
    torch.testing.assert_close(tail, state, atol=1e-10, rtol=0)


def test_float32_state_close_to_float64():
    """The production precision: float32 inputs and state, within float32 rounding of float64."""
    q, k, v, g, beta = random_inputs(2, 150, 2, 16, 16, seed=3)
    ref_out, ref_state = chunk_gated_delta_rule(q, k, v, g, beta)
    out, state = chunk_gated_delta_rule(*(x.float() for x in (q, k, v, g, beta)))
    assert state.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=0)
    torch.testing.assert_close(state.double(), ref_state, atol=2e-5, rtol=0)
