"""Plain full-recompute greedy decoding: the oracle the paged generator is tested against; and a
float64 paged decode attention, the oracle of the paged attention backends."""

import torch

from titanrl.models.logprobs import token_logprobs
from titanrl.models.model import Transformer


@torch.no_grad()
def greedy_reference(
    model: Transformer, prompt: list[int], max_new_tokens: int, eos_id: int | None = None
) -> tuple[list[int], list[float]]:
    """Re-run the whole sequence for every new token (no KV cache); returns (ids, logprobs)."""
    tokens = list(prompt)
    new_ids, logprobs = [], []
    for _ in range(max_new_tokens):
        if len(tokens) >= model.args.max_seq_len:
            break
        logits_V = model(torch.tensor([tokens]))[0, -1]
        token = int(torch.argmax(logits_V))
        logprobs.append(token_logprobs(logits_V[None, None], torch.tensor([[token]]))[0, 0].item())
        new_ids.append(token)
        tokens.append(token)
        if token == eos_id:
            break
    return new_ids, logprobs


def paged_decode_attention_reference(
    q_NGRD: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table_NM: torch.Tensor, pos_N: torch.Tensor
) -> torch.Tensor:
    """float64 attention of each row over its positions 0..pos, gathered slot by slot through its
    block table; K and V pages [pages, B, G, D] as `KVCachePool` holds them."""
    N, G, R, D = q_NGRD.shape
    B = v_pages.shape[1]
    k_SGD = k_pages.double().reshape(-1, G, D)  # [pages * B, G, D]
    v_SGD = v_pages.double().reshape(-1, G, D)
    out_NGRD = torch.empty(N, G, R, D, dtype=torch.float64)
    for n in range(N):
        L = int(pos_N[n]) + 1
        slots = table_NM[n].repeat_interleave(B)[:L] * B + torch.arange(L) % B
        scores_GRL = torch.einsum("grd,lgd->grl", q_NGRD[n].double(), k_SGD[slots]) * D**-0.5
        out_NGRD[n] = torch.einsum("grl,lgd->grd", scores_GRL.softmax(-1), v_SGD[slots])
    return out_NGRD
