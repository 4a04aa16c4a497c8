"""Sampling parameters and the sampler.

The returned logprob of a sampled token is `token_logprobs` of the raw (untempered) logits: the
same function, dtype and op order the trainer uses, so the two agree on what the policy is.
"""

from dataclasses import dataclass, field

import torch

from titanrl.components.loss import token_logprobs


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    """Most tokens generated per sample."""

    temperature: float = 1.0
    """Softmax temperature; 0 is greedy."""

    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""

    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; 1 disables."""

    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely one's; 0 disables."""

    n: int = 1
    """Samples per prompt (a GRPO group); they share the prompt's KV blocks."""

    seed: int | None = None
    """Seed of this request's random stream; the same seed gives the same samples."""

    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a sample (in addition to the generator's eos id); kept in the output."""

    stop_strings: list[str] = field(default_factory=list)
    """Strings that end a sample when the decoded completion ends with one (needs a tokenizer)."""

    num_top_logprobs: int = 0
    """Also return the top-k logprobs at each step."""

    def validate(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.num_top_logprobs < 0:
            raise ValueError(f"num_top_logprobs must be >= 0, got {self.num_top_logprobs}")


def _filtered_logits(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits_V.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p (the first is always kept).
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        logits = logits.masked_fill(drop_sorted.scatter(0, order, drop_sorted), float("-inf"))
    return logits


def sample_token(logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from one row of logits."""
    if params.temperature == 0:
        return int(torch.argmax(logits_V))
    probs = _filtered_logits(logits_V, params).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sampled_logprobs(logits_NV: torch.Tensor, tokens_N: torch.Tensor) -> torch.Tensor:
    """Logprobs of the chosen tokens under the unmodified policy, exactly as the trainer computes."""
    return token_logprobs(logits_NV.unsqueeze(0), tokens_N.unsqueeze(0)).squeeze(0)
