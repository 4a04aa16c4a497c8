"""Chunked prefill: a context longer than max_num_batched_tokens is prefilled over several
scheduler steps, each chunk attending to the K/V of the earlier ones, while the running samples
decode in between. Its logits and greedy generations equal a single-pass prefill's (bitwise in
batch-invariant mode; otherwise within float32 reassociation, 1e-5, see below), with GRPO
groups, prefix caching, preemption, multi-turn observations and MoE route recording (TP:
the `tp2_chunked` layout of tests/test_generator_multirank.py)."""

import dataclasses

import pytest
import torch
from helpers.reference import greedy_reference
from helpers.tiny import tiny_model, tiny_model_args

from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.models import Transformer

ARGS = tiny_model_args(max_seq_len=160)
CHUNK = 8
# 1x, 1.5x, 2x and 4x the chunk, mixed with short prompts in one batch.
LENGTHS = [8, 3, 12, 16, 5, 32, 2]
# Float32 without batch-invariant kernels: a chunked step packs other rows into its GEMMs and its
# decodes run in other batch compositions, so sums are reassociated (observed ~5e-7 on log-probs).
TOL = 1e-5


@pytest.fixture(scope="module")
def model() -> Transformer:
    m = tiny_model(ARGS, 0)
    return m.eval()


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100, (n,), generator=g).tolist() for n in lengths]


def _generator(model, args=ARGS, **config) -> Generator:
    config = {"block_size": 4, "num_blocks": 200, **config}
    gen = Generator(args, GeneratorConfig(**config), torch.device("cpu"))
    gen.load_weights(model)
    return gen


def _run(model, prompts, params, **config):
    return _generator(model, **config).generate(prompts, params)


def _max_logprob_diff(a, b) -> float:
    """Largest difference of the full log-softmax rows (top logprobs over the whole vocabulary)."""
    diff = 0.0
    for ca, cb in zip(a, b, strict=True):
        for rows_a, rows_b in zip(ca.top_logprobs, cb.top_logprobs, strict=True):
            da, db = dict(rows_a), dict(rows_b)
            assert da.keys() == db.keys()
            diff = max(diff, max(abs(da[t] - db[t]) for t in da))
    return diff


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_logits_and_greedy_match_single_pass_prefill(model, batch_invariant):
    """Every generated position's full log-softmax (the first one is the prefill's last row) and
    the greedy tokens equal a single-pass prefill's: bitwise with batch-invariant kernels."""
    prompts = _prompts(LENGTHS)
    params = SamplingParams(max_new_tokens=6, temperature=0, n=2, num_top_logprobs=ARGS.vocab_size)
    chunked, stats = _run(model, prompts, params, max_num_batched_tokens=CHUNK, batch_invariant=batch_invariant)
    single, single_stats = _run(model, prompts, params, batch_invariant=batch_invariant)
    assert stats.prefill_chunks >= 5 and single_stats.prefill_chunks == 0
    # Each group's prompt is prefilled once, chunks included.
    assert stats.prefill_tokens == single_stats.prefill_tokens == sum(LENGTHS)
    assert [c.token_ids for c in chunked] == [c.token_ids for c in single]
    if batch_invariant:
        assert [c.top_logprobs for c in chunked] == [c.top_logprobs for c in single]
        assert [c.logprobs for c in chunked] == [c.logprobs for c in single]
    else:
        assert _max_logprob_diff(chunked, single) < TOL


def test_decode_passes_and_reference_with_chunks(model):
    """The on-device decode passes (no top logprobs) after chunked prefills: tokens equal the
    full-recompute reference and the single-pass run, logprobs within TOL."""
    prompts = _prompts(LENGTHS, seed=2)
    params = SamplingParams(max_new_tokens=10, temperature=0, n=3)
    chunked, _ = _run(model, prompts, params, max_num_batched_tokens=CHUNK)
    single, _ = _run(model, prompts, params)
    refs = [greedy_reference(model, p, 10) for p in prompts]
    for c, s in zip(chunked, single, strict=True):
        ref_ids, ref_lps = refs[c.prompt_index]
        assert c.token_ids == s.token_ids == ref_ids
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref_lps)) < TOL


def _record_forward_sizes(gen: Generator) -> list[int]:
    """Tokens of every forward the generator issues (the embedding's input, [1, N])."""
    sizes: list[int] = []
    gen.model.tok_embeddings.register_forward_hook(lambda mod, args, out: sizes.append(args[0].numel()))
    return sizes


def test_largest_forward_is_bounded_by_the_chunk(model):
    """No forward of a chunked run holds more than a chunk of tokens (n = 1 and at most 7
    running samples: decode forwards stay below the chunk too); unchunked, the 32-token prompt is
    one forward."""
    prompts = _prompts(LENGTHS)
    params = SamplingParams(max_new_tokens=4, temperature=0)
    sizes = {}
    for name, budget in (("chunked", CHUNK), ("single", 4096)):
        gen = _generator(model, max_num_batched_tokens=budget)
        sizes[name] = _record_forward_sizes(gen)
        gen.generate(prompts, params)
    assert max(sizes["chunked"]) <= CHUNK
    assert max(sizes["single"]) >= max(LENGTHS)


def test_running_samples_decode_while_a_long_prompt_is_prefilled(model):
    """The short prompt's samples decode while the 4x-chunk prompt is still being prefilled; with
    chunking off, the long prompt is prefilled in one step before they decode again (the stall)."""
    prompts = _prompts([3, 4 * CHUNK])
    total = sum(len(p) for p in prompts)
    params = SamplingParams(max_new_tokens=6, temperature=0, n=2)
    for chunked in (True, False):
        passes: list[tuple[int, int]] = []  # (prefill tokens, decode tokens) after each pass

        def pause_when(finished, stats, passes=passes):
            passes.append((stats.prefill_tokens, stats.decode_tokens))
            return False

        config = dict(max_num_batched_tokens=CHUNK, enable_chunked_prefill=chunked, decode_steps_per_schedule=1)
        completions, stats = _generator(model, **config).generate(prompts, params, pause_when=pause_when)
        assert [len(c.token_ids) for c in completions] == [6] * 4
        decoded_during_prefill = [d for p, d in passes if p < total and d > 0]
        if chunked:
            assert len(decoded_during_prefill) == 4 and stats.prefill_chunks == 4  # a decode after every chunk
        else:
            assert not decoded_during_prefill and stats.prefill_chunks == 0


@pytest.mark.parametrize(
    "options",
    [
        dict(num_blocks=200),  # prefix caching: the second call reuses the first one's blocks
        dict(num_blocks=200, enable_prefix_caching=False),
        dict(num_blocks=16),  # tiny pool: preemption of running and part-prefilled sequences
    ],
)
def test_groups_prefix_caching_and_preemption(model, options):
    """GRPO groups fork after their prompt's last chunk; prompts sharing a long prefix hit the
    cache in a second call; a tiny pool preempts and recomputes. Greedy output equals the
    full-recompute reference throughout."""
    shared = _prompts([4 * CHUNK], seed=3)[0]
    prompts = [shared + [7, 8], _prompts([3])[0], shared[: 2 * CHUNK] + [9] * 6, _prompts([12], seed=4)[0]]
    gen = _generator(model, max_num_batched_tokens=CHUNK, **options)
    params = SamplingParams(max_new_tokens=8, temperature=0, n=3)
    refs = [greedy_reference(model, p, 8) for p in prompts]
    for call in range(2):
        completions, stats = gen.generate(prompts, params)
        for c in completions:
            assert c.token_ids == refs[c.prompt_index][0], (call, c.prompt_index)
            assert max(abs(a - b) for a, b in zip(c.logprobs, refs[c.prompt_index][1])) < TOL
        assert stats.prefill_chunks > 0
        if options["num_blocks"] == 16:
            assert stats.preemptions > 0
        elif call == 1 and options.get("enable_prefix_caching", True):
            assert stats.prefix_cache_hit_tokens >= 4 * CHUNK
        else:
            assert stats.prefill_tokens == sum(len(p) for p in prompts)  # once per group
        gen.allocator.check_invariants()


def test_a_part_prefilled_prompt_is_preempted_when_a_lone_running_sample_needs_a_block(model):
    """11 blocks of 4: the long prompt's chunks hold 9 of them; the one running sample outgrows
    the rest, so the part-prefilled prompt is preempted (not the sample) and recomputed later."""
    prompts = [_prompts([3])[0], _prompts([4 * CHUNK], seed=5)[0]]
    gen = _generator(model, num_blocks=11, max_num_batched_tokens=CHUNK)
    completions, stats = gen.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
    assert stats.preemptions > 0 and stats.prefill_tokens > sum(len(p) for p in prompts)
    for c in completions:
        assert c.token_ids == greedy_reference(model, prompts[c.prompt_index], 12)[0]
    gen.allocator.check_invariants()


def test_pausing_during_a_chunked_prefill_frees_its_blocks(model):
    """Partial rollouts: pausing after the first pass, while the long prompt is part-prefilled,
    returns its group's samples as paused (no tokens) and every block."""
    prompts = [_prompts([3])[0], _prompts([4 * CHUNK], seed=5)[0]]
    gen = _generator(model, max_num_batched_tokens=CHUNK, decode_steps_per_schedule=1)
    completions, stats = gen.generate(
        prompts, SamplingParams(max_new_tokens=12, temperature=0, n=2), pause_when=lambda f, s: True
    )
    assert stats.paused == 4 and [c.finish_reason for c in completions] == ["paused"] * 4
    assert [len(c.token_ids) for c in completions] == [2, 2, 0, 0]  # a first token, one decode step
    assert all(rc == 0 for rc in gen.allocator.ref_count)
    gen.allocator.check_invariants()


class _LongObservation:
    """A multi-turn environment: the first turn's answer gets a 2.5x-chunk observation, the
    second ends the episode."""

    def __init__(self) -> None:
        self.turns: dict[tuple[int, int], int] = {}
        self.ready: list[tuple[tuple[int, int], list[int] | None]] = []

    def submit(self, key, turn_token_ids, finish_reason) -> None:
        self.turns[key] = self.turns.get(key, 0) + 1
        obs = [(11 * key[0] + 3 * key[1] + i) % 100 for i in range(5 * CHUNK // 2)]
        self.ready.append((key, obs if self.turns[key] == 1 else None))

    def poll(self, block: bool):
        ready, self.ready = self.ready, []
        return ready


def test_multi_turn_observation_longer_than_the_chunk(model):
    prompts = _prompts([5, 2 * CHUNK])
    params = SamplingParams(max_new_tokens=4, temperature=0, n=2)
    runs = {}
    for budget in (CHUNK, 4096):
        gen = _generator(model, max_num_batched_tokens=budget)
        runs[budget] = gen.generate(prompts, params, turns=_LongObservation())
    (chunked, stats), (single, _) = runs[CHUNK], runs[4096]
    assert stats.resumed_turns == 4 and stats.prefill_chunks >= 4 + 4  # every observation is chunked
    assert [c.token_ids for c in chunked] == [c.token_ids for c in single]
    assert [c.model_mask for c in chunked] == [c.model_mask for c in single]
    assert max(abs(a - b) for c, s in zip(chunked, single) for a, b in zip(c.logprobs, s.logprobs)) < TOL


def _tiny_hf_qwen3_moe():
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))  # decisive routing: a wrong expert changes the logits
    return model.eval()


def test_hf_greedy_parity_and_moe_routes_with_chunks(tmp_path):
    """Chunked prefill under a transformers Qwen3-MoE: greedy equals `generate`, and the routes
    recorded chunk by chunk equal those of a single-pass prefill."""
    pytest.importorskip("transformers")
    from titanrl.models.hf import read_hf_config

    hf_model = _tiny_hf_qwen3_moe()
    hf_model.save_pretrained(tmp_path / "hf")
    args = read_hf_config(str(tmp_path / "hf"))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (8, 3, 12, 16, 5, 32)]
    runs = {}
    for budget in (CHUNK, 4096):
        gen = Generator(
            args, GeneratorConfig(block_size=4, num_blocks=256, max_num_batched_tokens=budget), torch.device("cpu")
        )
        gen.load_hf(str(tmp_path / "hf"))
        runs[budget] = gen.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0))
    (chunked, stats), (single, _) = runs[CHUNK], runs[4096]
    assert stats.prefill_chunks > 0
    for prompt, c, s in zip(prompts, chunked, single, strict=True):
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert c.token_ids == s.token_ids == out[0, len(prompt) :].tolist()
        assert c.routes.shape == s.routes.shape and (c.routes >= 0).all()
        assert torch.equal(c.routes, s.routes)


def test_config_documents_the_switch():
    config = GeneratorConfig()
    assert config.enable_chunked_prefill and config.max_num_batched_tokens == 4096
    assert dataclasses.replace(config, enable_chunked_prefill=False).validate() is None
