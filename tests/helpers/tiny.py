"""The tiny model and the short RL run the tests share: one definition each, varied by overrides.

Imported as `helpers.tiny` by the tests and as `tests.helpers.tiny` by the torchrun workers of
tests/multirank/ (which run with the repository root on the path)."""

import os

import torch

from titanrl.models import Transformer, TransformerModelArgs

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBUG_CONFIG = os.path.join(_REPO_ROOT, "train_configs", "grpo_reverse_debug.toml")
MOE_DEBUG_CONFIG = os.path.join(_REPO_ROOT, "train_configs", "grpo_moe_reverse_debug.toml")

# A Qwen3-like block: QK-norm, grouped-query attention (4 query / 2 kv heads), tied embeddings.
_TINY = dict(
    family="qwen3",
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    hidden_dim=96,
    vocab_size=101,
    qk_norm=True,
    tie_word_embeddings=True,
    max_seq_len=96,
)
# The Qwen2-like variant: q/k/v biases, no QK-norm, an untied output layer.
_QWEN2 = dict(family="qwen2", qkv_bias=True, qk_norm=False, tie_word_embeddings=False)


def tiny_model_args(**overrides) -> TransformerModelArgs:
    """The tiny Qwen3-like model of the unit tests (2 layers of width 64, a 96-wide MLP, a
    101-token vocabulary, 96 positions); any field given replaces its value."""
    return TransformerModelArgs(**{**_TINY, **overrides})


def tiny_qwen2_args(**overrides) -> TransformerModelArgs:
    """The tiny model in its Qwen2-like form (q/k/v biases, untied output); overrides as above."""
    return tiny_model_args(**{**_QWEN2, **overrides})


def tiny_model(args: TransformerModelArgs | None = None, seed: int = 0) -> Transformer:
    """A model of `args` (default: the tiny one) with weights initialised under `seed`."""
    torch.manual_seed(seed)
    model = Transformer(args or tiny_model_args())
    model.init_weights()
    return model


def smoke_run_args(
    *extra: str,
    config: str | None = DEBUG_CONFIG,
    steps: int | None = 3,
    sft_steps: int | None = 4,
    batch_size: int = 4,
    group_size: int = 4,
    max_new_tokens: int | None = 6,
    eval_samples: int = 8,
) -> list[str]:
    """The command-line arguments of a short RL run of the debug job: `steps` RL steps after
    `sft_steps` SFT warm-up steps (in batches of 8), `batch_size` prompts of `group_size` samples
    of `max_new_tokens` new tokens, `eval_samples` held-out prompts evaluated only at the start and
    the end, one reward worker. A None leaves that key to the config file (`config`: None for a
    command that names the file itself). `extra` comes last: it adds keys or overrides these (the
    last value of a key wins)."""
    args = [f"--job.config_file={config}"] if config is not None else []
    if steps is not None:
        args.append(f"--training.steps={steps}")
    if sft_steps is not None:
        args += (
            [f"--sft_warmup.steps={sft_steps}", "--sft_warmup.batch_size=8"] if sft_steps else ["--sft_warmup.steps=0"]
        )
    args += [f"--training.batch_size={batch_size}", f"--algorithm.group_size={group_size}"]
    if max_new_tokens is not None:
        args.append(f"--generator.max_new_tokens={max_new_tokens}")
    args += [f"--data.num_eval_samples={eval_samples}", "--reward.num_workers=1", "--metrics.eval_freq=0"]
    return [*args, *extra]
