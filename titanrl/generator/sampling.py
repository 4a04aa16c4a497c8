"""Sampling parameters and the sampler.

The returned logprob of a sampled token is `token_logprobs` of the raw (untempered) logits: the
same function, dtype and op order the trainer uses, so the two agree on what the policy is.
"""

from dataclasses import dataclass, field

import torch

from titanrl.models.logprobs import token_logprobs


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


def _filtered_logits(logits_XV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Tempered logits of any leading shape X with top-k / min-p / top-p's dropped tokens at -inf."""
    logits = logits_XV.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already reach top_p (the first is always kept).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits


_M32 = 0xFFFF_FFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in int64 without overflow (16-bit halves)."""
    return (((((x >> 16) * c) & 0xFFFF) << 16) + (x & 0xFFFF) * c) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(key_N: torch.Tensor, counter_N: torch.Tensor) -> torch.Tensor:
    """A float64 uniform in [0, 1) per row that depends only on (key, counter): a stateless
    random stream. A sample's key is fixed when it is forked and the counter is the position of
    the token being drawn, so a draw does not depend on batching, on how many steps run between
    scheduler passes, or on preemption; it runs on device without per-row generator objects."""
    lo, hi, c = key_N & _M32, (key_N >> 32) & _M32, counter_N & _M32
    a = _mix32(_mix32(c ^ hi) ^ lo)
    b = _mix32(a ^ hi ^ 0x9E3779B9)
    # 26 + 26 high-quality bits: a 52-bit mantissa.
    return ((a >> 6) * (1 << 26) + (b >> 6)).to(torch.float64) * 2.0**-52


def first_argmax(logits_NV: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(logits_NV, -1)` (the first index of the row's maximum) as a max and a min
    over indices: compiled, plain vectorised reductions instead of argmax's (index, value) one.
    A row with a NaN
    gives the last index (argmax: the NaN's)."""
    max_N1 = logits_NV.amax(-1, keepdim=True)
    index_V = torch.arange(logits_NV.shape[-1], device=logits_NV.device)
    return torch.where(logits_NV == max_N1, index_V, logits_NV.shape[-1]).amin(-1).clamp(max=logits_NV.shape[-1] - 1)


def sample_tokens(
    logits_NV: torch.Tensor, params: SamplingParams, key_N: torch.Tensor | None, counter_N: torch.Tensor | None
) -> torch.Tensor:
    """One token id per row: argmax for temperature 0, else a draw from the filtered softmax.

    A draw is one uniform number from the row's stateless stream (`counter_uniform`), inverted
    through the row's CDF: `torch.multinomial` draws one random number per vocabulary entry
    (150k per row at a real vocabulary); this draws one. All tensor ops: it runs inside the
    compiled decode step.
    """
    if params.temperature == 0:
        return first_argmax(logits_NV)
    assert key_N is not None and counter_N is not None, "a draw needs the rows' random streams"
    probs_NV = _filtered_logits(logits_NV, params).softmax(-1)
    cdf_NV = probs_NV.cumsum(-1, dtype=torch.float64)
    u_N = counter_uniform(key_N, counter_N)
    # The first index whose cumulative probability exceeds u: a token of probability 0 has an
    # empty interval and is never drawn.
    drawn_N = torch.searchsorted(cdf_NV, (u_N * cdf_NV[:, -1])[:, None], right=True)[:, 0]
    return drawn_N.clamp(max=logits_NV.shape[-1] - 1)


def sampled_logprobs(logits_NV: torch.Tensor, tokens_N: torch.Tensor) -> torch.Tensor:
    """Logprobs of the chosen tokens under the unmodified policy, exactly as the trainer computes."""
    return token_logprobs(logits_NV.unsqueeze(0), tokens_N.unsqueeze(0)).squeeze(0)


def validate_prompts(prompts: list[list[int]], max_seq_len: int, vocab_size: int) -> None:
    """Every prompt non-empty, shorter than the model's context, with ids in the vocabulary."""
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(prompt) >= max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens but the model context is {max_seq_len}; "
                "shorten the prompt or raise model.max_seq_len"
            )
        if any(not 0 <= t < vocab_size for t in prompt):
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
