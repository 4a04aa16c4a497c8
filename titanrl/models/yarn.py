"""YaRN RoPE scaling as transformers' `_compute_yarn_parameters` computes it (gpt-oss, DeepSeek-V3)."""

import math

import torch

from titanrl.models.args import YarnRope


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, yarn: YarnRope) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], the attention factor that scales cos and sin)."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    if yarn.attention_factor:
        return inv_freq, yarn.attention_factor
    if yarn.mscale and yarn.mscale_all_dim:  # DeepSeek-V3
        return inv_freq, yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return inv_freq, yarn_mscale(yarn.factor)
