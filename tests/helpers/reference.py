"""Plain full-recompute greedy decoding: the oracle the paged generator is tested against; and a
float64 paged attention, the oracle of the paged attention backends."""

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


def paged_attention_reference(
    q_NHD: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tables: list[list[int]],
    positions: list[list[int]],
) -> torch.Tensor:
    """float64 attention of packed queries (sequence-major: sequence s's queries at `positions[s]`)
    over each sequence's positions 0..pos, read slot by slot through its block table; K and V
    pages [pages, B, Hkv, D] as `KVCachePool` holds them, H / Hkv query heads per KV head."""
    N, H, D = q_NHD.shape
    B, Hkv = v_pages.shape[1], v_pages.shape[2]
    k_LGD, v_LGD = k_pages.double().reshape(-1, Hkv, D), v_pages.double().reshape(-1, Hkv, D)
    out_NHD = torch.empty(N, H, D, dtype=torch.float64)
    n = 0
    for table, pos in zip(tables, positions):
        for p in pos:
            slots = torch.tensor([table[t // B] * B + t % B for t in range(p + 1)])
            k_LHD = k_LGD[slots].repeat_interleave(H // Hkv, 1)
            v_LHD = v_LGD[slots].repeat_interleave(H // Hkv, 1)
            probs_HL = torch.einsum("hd,lhd->hl", q_NHD[n].double(), k_LHD).mul(D**-0.5).softmax(-1)
            out_NHD[n] = torch.einsum("hl,lhd->hd", probs_HL, v_LHD)
            n += 1
    return out_NHD
