"""Route recording with prefix caching: a prompt whose first blocks come from the prefix cache
takes those blocks' recorded routes (`generator/routes.py`), so the routes of every fed token
equal those of a generator that recomputes every prompt."""

import dataclasses

import pytest
import torch

from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.models import Transformer
from titanrl.models.args import TransformerModelArgs

CPU = torch.device("cpu")
ARGS = TransformerModelArgs(
    family="qwen3_moe",
    dim=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    hidden_dim=64,
    vocab_size=128,
    qk_norm=True,
    tie_word_embeddings=True,
    max_seq_len=64,
    moe_num_experts=8,
    moe_top_k=2,
    moe_intermediate_size=32,
    moe_mlp_only_layers=[1],
)


def _prompts() -> list[list[int]]:
    """Six prompts: two shared prefixes (2 and 3 blocks of 4 tokens), then their own tokens."""
    g = torch.Generator().manual_seed(5)
    prefixes = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (8, 12)]
    return [prefixes[i % 2] + torch.randint(1, 128, (1 + i,), generator=g).tolist() for i in range(6)]


def _generate(model: Transformer, caching: bool, **config) -> tuple[list, object]:
    # At most 16 prompt tokens per pass: groups are admitted over several passes, so later ones
    # find the earlier ones' prompt blocks in the cache.
    cfg = GeneratorConfig(
        block_size=4, num_blocks=128, enable_prefix_caching=caching, batch_invariant=True, max_num_batched_tokens=16
    )
    gen = Generator(ARGS, dataclasses.replace(cfg, **config), CPU)
    gen.load_weights(model)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=0)
    first, _ = gen.generate(_prompts(), params)
    again, stats = gen.generate(_prompts()[::-1], params)  # every prompt block now cached
    return first + again, stats


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights(buffer_device=CPU)
    return model.eval()


def test_routes_with_prefix_caching_equal_routes_without(model):
    # Cached prompts also prefilled in chunks of 6 tokens (chunked prefill: a chunk after a cache
    # hit starts mid-prompt, and only the first takes the cached blocks' routes).
    cached, stats = _generate(model, caching=True, max_num_batched_tokens=6)
    uncached, uncached_stats = _generate(model, caching=False)
    assert stats.prefix_cache_hit_tokens > 0 and uncached_stats.prefix_cache_hit_tokens == 0
    for a, b in zip(cached, uncached, strict=True):
        assert a.token_ids == b.token_ids
        assert a.routes is not None and (a.routes >= 0).all()  # every fed token has its routes
        assert torch.equal(a.routes, b.routes)


def test_routes_recorded_under_compile_equal_eager(model):
    """The compiled decode step (`generator.compile`, aot_eager: dynamo's graphs run eagerly)
    records the same routes as eager decoding, and greedy decoding picks the same tokens. The
    MoE block's CPU float32 expert loop (`GroupedExperts.forward_loop`: a split by the counts
    read on the host) breaks the graph once per MoE layer and step shape; each block's frame
    then compiles on its own, which is why MoE models keep their module guards (`compile_decode`)."""
    params = SamplingParams(max_new_tokens=6, temperature=0.0, n=2)
    out = {}
    for compiled in (False, True):
        cfg = GeneratorConfig(block_size=4, num_blocks=128, compile=compiled, compile_backend="aot_eager")
        gen = Generator(ARGS, cfg, CPU)
        gen.load_weights(model)
        out[compiled], _ = gen.generate(_prompts(), params)
    for a, b in zip(out[False], out[True], strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.routes, b.routes)
