"""Plain full-recompute greedy decoding: the oracle the paged generator is tested against."""

import torch

from titanrl.components.loss import token_logprobs
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
