from dataclasses import dataclass, field
from typing import Literal


@dataclass
class RopeScaling:
    """Llama-3.1 style frequency-dependent RoPE scaling ('rope_type': 'llama3' in HF configs)."""

    factor: float = 8.0
    """Wavelengths longer than original_max_position_embeddings / low_freq_factor are divided by this."""

    low_freq_factor: float = 1.0
    """Sets the wavelength above which frequencies are fully scaled."""

    high_freq_factor: float = 4.0
    """Sets the wavelength below which frequencies are left unchanged."""

    original_max_position_embeddings: int = 8192
    """Context length the model was pre-trained with."""


# gpt-oss
@dataclass
class YarnRope:
    """YaRN RoPE scaling ('rope_type': 'yarn' in HF configs), as transformers computes it."""

    factor: float = 32.0
    """Context extension factor: low frequencies are divided by it."""

    beta_fast: float = 32.0
    """Rotations above which a frequency is left unchanged (extrapolated)."""

    beta_slow: float = 1.0
    """Rotations below which a frequency is fully interpolated."""

    original_max_position_embeddings: int = 4096
    """Context length the model was pre-trained with."""

    truncate: bool = True
    """Round the correction range to whole dimensions (HF `truncate`; gpt-oss sets it false)."""

    attention_factor: float = 0.0
    """Scale of cos and sin (so of q.k by its square); 0: mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are set (DeepSeek-V3), else 0.1 * ln(factor) + 1."""

    mscale: float = 0.0
    """DeepSeek-V3: numerator of the cos/sin scale (HF `mscale`); 0: unset."""

    mscale_all_dim: float = 0.0
    """DeepSeek-V3: denominator of that scale, and MLA's softmax scale is multiplied by
    mscale(factor, mscale_all_dim) ** 2 (HF `mscale_all_dim`); 0: unset."""


Family = Literal["llama3", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "gpt_oss", "deepseek_v3"]
"""The architecture families titanrl implements."""


@dataclass
class TransformerModelArgs:
    """Shape of a decoder-only transformer of the Llama-3 / Qwen2 / Qwen3 / Qwen3-MoE families."""

    family: Family = "llama3"
    """Architecture family; decides the HF model_type on export."""

    dim: int = 256
    """Hidden size."""

    n_layers: int = 4
    """Number of transformer blocks."""

    n_heads: int = 4
    """Query heads."""

    n_kv_heads: int = 4
    """Key/value heads (grouped-query attention when fewer than n_heads)."""

    head_dim: int = 0
    """Per-head dimension; 0 means dim // n_heads (Qwen3 sets it explicitly)."""

    hidden_dim: int = 768
    """SwiGLU intermediate size."""

    vocab_size: int = 320
    """Embedding rows; must cover every token id the tokenizer produces."""

    norm_eps: float = 1e-6
    """RMSNorm epsilon."""

    rope_theta: float = 10000.0
    """RoPE base frequency."""

    rope_scaling: RopeScaling | None = None
    """Llama-3.1 style long-context scaling of RoPE frequencies; None for plain RoPE."""

    max_seq_len: int = 2048
    """Positions covered by the precomputed RoPE table."""

    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""

    o_bias: bool = False
    """Bias on the attention output projection (Llama with attention_bias=True)."""

    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""

    tie_word_embeddings: bool = False
    """Output projection shares the token-embedding matrix."""

    num_labels: int = 0
    """0: a language-model head over the vocabulary. N > 0: a score head of N outputs instead
    (reward model or critic; HF `*ForSequenceClassification` layout, `score.weight`)."""

    depth_init: bool = True
    """Scale each block's output-projection init std by its depth (TorchTitan's init)."""

    moe_num_experts: int = 0
    """Routed experts per mixture-of-experts layer; 0: every layer is a dense SwiGLU (HF
    `num_experts`)."""

    moe_top_k: int = 2
    """Experts each token is routed to (HF `num_experts_per_tok`)."""

    moe_intermediate_size: int = 0
    """SwiGLU intermediate size of each routed (and shared) expert; 0 means hidden_dim."""

    moe_shared_experts: int = 0
    """Always-on shared experts (DeepSeek style), one SwiGLU of moe_intermediate_size times this
    width added to the routed output; Qwen3-MoE has none."""

    moe_decoder_sparse_step: int = 1
    """Layer i is MoE when (i + 1) % step == 0 and i is not in moe_mlp_only_layers (HF
    `decoder_sparse_step`)."""

    moe_mlp_only_layers: list[int] = field(default_factory=list)
    """Layers that stay dense SwiGLU of hidden_dim (HF `mlp_only_layers`)."""

    moe_norm_topk_prob: bool = True
    """Renormalise the top-k softmax probabilities to sum to 1 (HF `norm_topk_prob`)."""

    moe_expert_bias: bool = False
    """Auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias, updated outside
    autograd from the expert loads, is added to the scores for top-k selection only. The bias
    is then a persistent buffer of the checkpoint; HF export needs it off."""

    # Qwen3.5
    layer_types: list[str] = field(default_factory=list)
    """Per block, "full_attention", "sliding_attention" (gpt-oss: the last `sliding_window` keys)
    or "linear_attention" (Qwen3.5: a gated DeltaNet layer, `models/gated_deltanet.py`); empty:
    every block is full attention (HF `layer_types`)."""

    attn_output_gate: bool = False
    """Full attention multiplies its output by sigmoid of a per-head gate that q's projection
    also produces (Qwen3.5: q_proj rows are [q, gate] per head)."""

    partial_rotary_factor: float = 1.0
    """Fraction of each head's dims that RoPE rotates (the first ones); Qwen3.5 uses 0.25."""

    linear_conv_kernel_dim: int = 4
    """Width of the causal depthwise convolution over the linear layers' q/k/v."""

    linear_key_head_dim: int = 128
    """Per-head dimension of the linear layers' queries and keys."""

    linear_value_head_dim: int = 128
    """Per-head dimension of the linear layers' values (and of their recurrent state's columns)."""

    linear_num_key_heads: int = 16
    """Query/key heads of a linear layer."""

    linear_num_value_heads: int = 32
    """Value heads of a linear layer (a multiple of linear_num_key_heads: each key head serves
    that many consecutive value heads)."""

    def is_linear_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` is a gated DeltaNet layer instead of full attention."""
        return bool(self.layer_types) and self.layer_types[layer_id] == "linear_attention"

    @property
    def has_linear_layers(self) -> bool:
        """Whether some block is a linear-attention layer (a hybrid model)."""
        return "linear_attention" in self.layer_types

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    def _check_layer_types(self) -> None:
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries; n_layers is {self.n_layers}")
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention", "linear_attention"}
        if unknown:
            raise ValueError(
                f"layer_types: unknown {sorted(unknown)}; use full_attention, sliding_attention or linear_attention"
            )
        if "sliding_attention" in self.layer_types and self.sliding_window < 1:
            raise ValueError(f"sliding_window ({self.sliding_window}) must be >= 1 with sliding_attention layers")
        if self.linear_num_value_heads % self.linear_num_key_heads != 0:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.rotary_dim % 2 != 0 or self.rotary_dim == 0:
            raise ValueError(
                f"partial_rotary_factor ({self.partial_rotary_factor}) must give an even, non-zero rotary dim"
            )

    # gpt-oss
    sliding_window: int = 0
    """Keys a query of a sliding-window layer sees, itself included (HF `sliding_window`)."""

    rope_yarn: YarnRope | None = None
    """YaRN RoPE scaling (gpt-oss, DeepSeek-V3; `models/yarn.py`); None for plain RoPE (or
    rope_scaling's Llama-3.1 scaling)."""

    swiglu_alpha: float = 1.702
    """gpt-oss experts: sigmoid gain of the clamped SwiGLU, gate * sigmoid(alpha * gate)."""

    swiglu_limit: float = 7.0
    """gpt-oss experts: the gate is clamped above and the up projection on both sides at this."""

    def layer_window(self, layer_id: int) -> int:
        """Keys a query of block `layer_id` sees (0: all before it, full causal attention)."""
        if self.layer_types and self.layer_types[layer_id] == "sliding_attention":
            return self.sliding_window
        return 0

    # DeepSeek-V3
    kv_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V3) when > 0: rank of the compressed key/value
    latent that the generator caches (HF `kv_lora_rank`); 0: ordinary attention."""

    q_lora_rank: int = 0
    """MLA: rank of the low-rank query projection (with its RMSNorm); 0: a plain q projection."""

    qk_nope_head_dim: int = 0
    """MLA: per-head query/key dimension without RoPE."""

    qk_rope_head_dim: int = 0
    """MLA: per-head query/key dimension with RoPE (the key part shared by all heads)."""

    v_head_dim: int = 0
    """MLA: per-head value dimension."""

    rope_interleave: bool = False
    """RoPE rotates interleaved pairs (x0, x1), (x2, x3) ... (DeepSeek's layout) instead of halves."""

    moe_score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over experts (Qwen3-MoE) or per-expert sigmoid (DeepSeek-V3)."""

    moe_n_group: int = 1
    """Expert groups of group-limited routing (HF `n_group`): a token picks experts only in its
    `moe_topk_group` best groups, a group scored by the sum of its top-2 biased scores."""

    moe_topk_group: int = 1
    """Groups a token may route to (HF `topk_group`)."""

    moe_routed_scaling_factor: float = 1.0
    """Routing weights are multiplied by this after normalisation (HF `routed_scaling_factor`)."""

    moe_mtp_layers: int = 0
    """Multi-token-prediction layers of the HF checkpoint (`num_nextn_predict_layers`): their
    weights are skipped on import (with one notice), so the export lists none."""

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` has a mixture-of-experts feed-forward (Qwen3-MoE's rule)."""
        return (
            self.moe_num_experts > 0
            and layer_id not in self.moe_mlp_only_layers
            and (layer_id + 1) % self.moe_decoder_sparse_step == 0
        )

    @property
    def moe_hidden_dim(self) -> int:
        """Intermediate size of one routed expert."""
        return self.moe_intermediate_size or self.hidden_dim

    @property
    def ties_output(self) -> bool:
        """The output projection is the embedding matrix (never for a score head)."""
        return self.tie_word_embeddings and self.num_labels == 0

    def __post_init__(self) -> None:
        if self.kv_lora_rank > 0 and self.head_dim == 0:
            self.head_dim = self.qk_rope_head_dim  # MLA: the RoPE table covers the rope part only
        if self.head_dim == 0:
            if self.dim % self.n_heads != 0:
                raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}) or set head_dim")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.moe_num_experts > 0 and not 1 <= self.moe_top_k <= self.moe_num_experts:
            raise ValueError(f"moe_top_k ({self.moe_top_k}) must be in [1, moe_num_experts={self.moe_num_experts}]")
        if self.moe_num_experts > 0 and (self.moe_n_group < 1 or self.moe_num_experts % self.moe_n_group):
            raise ValueError(f"moe_n_group ({self.moe_n_group}) must divide moe_num_experts ({self.moe_num_experts})")
        if not 1 <= self.moe_topk_group <= self.moe_n_group:
            raise ValueError(f"moe_topk_group ({self.moe_topk_group}) must be in [1, moe_n_group={self.moe_n_group}]")
        if self.kv_lora_rank > 0 and self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for RoPE")
        if self.moe_decoder_sparse_step < 1:
            raise ValueError(f"moe_decoder_sparse_step ({self.moe_decoder_sparse_step}) must be >= 1")
        self._check_layer_types()
