"""Paged generator vs a full-recompute reference, prefix caching, preemption, sampling, sync."""

import math
import os
import sys

import pytest
import torch
from helpers.reference import greedy_reference
from helpers.tiny import tiny_model, tiny_model_args
from hypothesis import given, settings
from hypothesis import strategies as st

from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.generator.kv_cache import BlockAllocator, KVCachePool, OutOfBlocks, block_hashes
from titanrl.generator.scheduler import Scheduler
from titanrl.generator.sequence import Seq
from titanrl.models import Transformer, TransformerModelArgs
from titanrl.models.logprobs import token_logprobs

ARGS = tiny_model_args()


def _trainer_model(seed: int = 0) -> Transformer:
    model = tiny_model(ARGS, seed)
    return model.eval()


def _generator(model, **config) -> Generator:
    gen = Generator(ARGS, GeneratorConfig(**config), torch.device("cpu"))
    gen.load_weights(model)
    return gen


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize(
    "options",
    [
        dict(block_size=4, num_blocks=128),  # roomy, prefix caching on
        dict(block_size=4, num_blocks=128, enable_prefix_caching=False),
        dict(block_size=4, num_blocks=15),  # tiny pool: forced preemption
        dict(block_size=16, num_blocks=64, max_num_seqs=3),  # admission limited by max_num_seqs
        dict(block_size=4, num_blocks=128, compile=True),  # compiled FlexAttention over the pages
        dict(block_size=4, num_blocks=15, compile=True),  # ... with preemption
        dict(block_size=4, num_blocks=15, attention_impl="exact"),  # the batch-invariant attention
    ],
)
def test_greedy_matches_full_recompute_reference(options):
    model = _trainer_model()
    gen = _generator(model, **options)
    prompts = _prompts([3, 9, 17, 4, 30])
    completions, stats = gen.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0, n=2))
    assert [(c.prompt_index, c.sample_index) for c in completions] == [(i, s) for i in range(5) for s in range(2)]
    for c in completions:
        ref_ids, ref_lps = greedy_reference(model, prompts[c.prompt_index], 24)
        assert c.token_ids == ref_ids
        assert c.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref_lps)) < 1e-5
    if options["num_blocks"] == 15:  # the tiny pools
        assert stats.preemptions > 0
    gen.allocator.check_invariants()


def test_logprobs_match_trainer_forward():
    """Sampled (temperature 1) sequences: generator logprobs vs the trainer's forward on them."""
    model = _trainer_model()
    gen = _generator(model, block_size=4, num_blocks=256)
    prompts = _prompts([5, 11, 20, 7])
    completions, _ = gen.generate(prompts, SamplingParams(max_new_tokens=30, temperature=1.0, n=4, seed=3))
    max_diff, kl_k1 = 0.0, []
    for c in completions:
        seq = prompts[c.prompt_index] + c.token_ids
        P = len(prompts[c.prompt_index])
        with torch.no_grad():
            logits_BTV = model(torch.tensor([seq[:-1]]))
        trainer_lp = token_logprobs(logits_BTV, torch.tensor([seq[1:]]))[0, P - 1 :]
        gen_lp = torch.tensor(c.logprobs)
        max_diff = max(max_diff, (trainer_lp - gen_lp).abs().max().item())
        # k1 estimate of KL(generator || trainer) on the generator's own samples.
        kl_k1.append((gen_lp - trainer_lp).mean().item())
    assert max_diff < 1e-5
    assert abs(sum(kl_k1) / len(kl_k1)) < 1e-6


def test_prefix_caching_prefills_a_group_prompt_once():
    model = _trainer_model()
    gen = _generator(model, block_size=4, num_blocks=128)
    prompt = _prompts([19])[0]  # not a multiple of the block size: the last block is shared, then copied
    G = 8
    completions, stats = gen.generate([prompt], SamplingParams(max_new_tokens=6, temperature=1.0, n=G, seed=0))
    assert len(completions) == G
    assert stats.prefill_tokens == len(prompt)
    # A second request with the same 16-token prefix reuses 4 cached blocks.
    _, stats2 = gen.generate([prompt[:16] + [7, 8, 9]], SamplingParams(max_new_tokens=2, temperature=0))
    assert stats2.prefix_cache_hit_tokens == 16
    assert stats2.prefill_tokens == 3
    gen.allocator.check_invariants()


def test_prefix_caching_off_recomputes_shared_prefix():
    gen = _generator(_trainer_model(), block_size=4, num_blocks=128, enable_prefix_caching=False)
    prompt = _prompts([19])[0]
    gen.generate([prompt], SamplingParams(max_new_tokens=2, temperature=0))
    _, stats = gen.generate([prompt], SamplingParams(max_new_tokens=2, temperature=0))
    assert stats.prefix_cache_hit_tokens == 0 and stats.prefill_tokens == 19


def test_seeded_sampling_is_reproducible_and_independent_of_batching():
    model = _trainer_model()
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, n=3, seed=11)
    prompts = _prompts([6, 13])
    a, _ = _generator(model, block_size=4, num_blocks=128).generate(prompts, params)
    b, _ = _generator(model, block_size=4, num_blocks=10).generate(prompts, params)  # preempting
    c, _ = _generator(model, block_size=4, num_blocks=128).generate(
        prompts, SamplingParams(**{**params.__dict__, "seed": 12})
    )
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    assert len({tuple(x.token_ids) for x in a}) > 1  # samples of a group differ


def test_sampling_filters_restrict_support():
    from titanrl.generator.sampling import _filtered_logits

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    keep = lambda p: torch.isfinite(_filtered_logits(logits, p)).tolist()  # noqa: E731
    assert keep(SamplingParams(top_k=2)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.8)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.81)) == [True, True, True, False]
    assert keep(SamplingParams(min_p=0.35)) == [True, True, False, False]
    assert keep(SamplingParams(top_p=0.1)) == [True, False, False, False]


def test_sampler_draws_from_the_filtered_distribution():
    """sample_tokens (one uniform per row through the row's CDF): 40,000 draws from the
    stateless streams (4 keys x 10,000 counters) match the tempered, filtered softmax to 3
    standard errors per token, filtered tokens never come, greedy rows are argmax, and a row's
    draw depends only on its own (key, counter)."""
    from titanrl.generator.sampling import _filtered_logits, sample_tokens

    logits_V = torch.log(torch.tensor([0.05, 0.4, 0.0, 0.25, 0.2, 0.1]))
    n = 40_000
    keys_N = torch.tensor([1, 2, 2**40 + 7, 2**62 + 3]).repeat_interleave(n // 4)
    counters_N = torch.arange(n // 4).repeat(4) + 17
    for params in (SamplingParams(temperature=0.7), SamplingParams(top_k=3), SamplingParams(top_p=0.8)):
        drawn = sample_tokens(logits_V.expand(n, 6), params, keys_N, counters_N)
        counts = torch.bincount(drawn, minlength=6).float()
        expected = _filtered_logits(logits_V, params).softmax(-1)
        stderr = (expected * (1 - expected) / n).sqrt()
        assert ((counts / n - expected).abs() <= 3 * stderr + 1e-9).all(), (params, counts / n, expected)
        assert counts[expected == 0].sum() == 0
    logits_NV = torch.randn(3, 151_936)
    hot = SamplingParams(temperature=1.0)
    assert sample_tokens(logits_NV, SamplingParams(temperature=0), None, None).tolist() == logits_NV.argmax(-1).tolist()
    ties_NV = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0], [-1.0, -2.0, -3.0, -1.0]])
    assert sample_tokens(ties_NV, SamplingParams(temperature=0), None, None).tolist() == [1, 0, 0]  # argmax's first
    together = sample_tokens(logits_NV, hot, torch.tensor([5, 6, 7]), torch.tensor([3, 3, 9]))
    alone = sample_tokens(logits_NV[2:], hot, torch.tensor([7]), torch.tensor([9]))
    other = sample_tokens(logits_NV[2:].expand(8, -1), hot, torch.arange(8) + 100, torch.tensor([9] * 8))
    assert together[2] == alone[0] and len(set(other.tolist())) > 1


def test_stop_conditions():
    model = _trainer_model()
    gen = _generator(model, block_size=4, num_blocks=64)
    prompt = _prompts([5])[0]
    ref, _ = greedy_reference(model, prompt, 10)
    (c,), _ = gen.generate([prompt], SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=[ref[3]]))
    first = ref.index(ref[3])
    assert c.token_ids == ref[: first + 1] and c.finish_reason == "stop"
    for eos_id, extra in [(ref[2], ()), (None, (ref[9], ref[2]))]:  # several EOS ids stop alike
        gen = Generator(
            ARGS, GeneratorConfig(block_size=4, num_blocks=64), torch.device("cpu"), eos_id=eos_id, extra_eos_ids=extra
        )
        gen.load_weights(model)
        (c,), _ = gen.generate([prompt], SamplingParams(max_new_tokens=10, temperature=0))
        assert c.token_ids == ref[: ref.index(ref[2]) + 1] and c.finish_reason == "stop"


def test_prefill_projects_only_the_sampled_rows_at_real_vocabulary():
    """At a 151,936-token vocabulary the output layer sees one row per prefilled sequence (its
    last token), never every prompt token; greedy output still equals the reference."""
    args = TransformerModelArgs(
        family="qwen2",
        dim=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        hidden_dim=64,
        vocab_size=151_936,
        tie_word_embeddings=True,
        max_seq_len=160,
    )
    model = tiny_model(args, 0)
    gen = Generator(args, GeneratorConfig(block_size=16, num_blocks=64), torch.device("cpu"))
    gen.load_weights(model)
    rows = []
    gen.model.output.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[:-1].numel()))
    prompts = [list(range(1000, 1120)), list(range(5000, 5090))]
    completions, stats = gen.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0, n=3))
    assert stats.prefill_tokens == 210 and rows[0] == 2  # one packed prefill of both prompts
    assert all(r <= 6 for r in rows[1:])  # decode steps: one row per running sample
    for c in completions:
        assert c.token_ids == greedy_reference(model, prompts[c.prompt_index], 4)[0]


class _LetterTokenizer:
    """Each id decodes to one letter, so every completion has printable text."""

    eos_id = None

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_strings_with_tokenizer():
    model = _trainer_model()
    config = GeneratorConfig(block_size=4, num_blocks=64)
    gen = Generator(ARGS, config, torch.device("cpu"), tokenizer=_LetterTokenizer())
    gen.load_weights(model)
    prompt = _prompts([5])[0]
    (free,), _ = gen.generate([prompt], SamplingParams(max_new_tokens=20, temperature=0))
    target = free.text[3:5]
    (c,), _ = gen.generate([prompt], SamplingParams(max_new_tokens=20, temperature=0, stop_strings=[target]))
    assert c.finish_reason == "stop"
    assert c.text == free.text[: free.text.index(target) + len(target)]


def test_load_weights_in_place_follows_trainer_updates():
    model = _trainer_model()
    gen = _generator(model, block_size=4, num_blocks=64)
    ptrs = {n: p.data_ptr() for n, p in gen.model.named_parameters()}
    prompt = _prompts([7])[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(20):
        model.train()
        model(torch.tensor([prompt])).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        gen.load_weights(model)
        assert {n: p.data_ptr() for n, p in gen.model.named_parameters()} == ptrs  # in place
    model.eval()
    (c,), _ = gen.generate([prompt], SamplingParams(max_new_tokens=10, temperature=0))
    assert c.token_ids == greedy_reference(model, prompt, 10)[0]


def test_shared_weights_are_the_trainers_storage_and_follow_its_updates():
    """share_weights on one rank: the generator's parameters are the trainer's tensors (no
    second copy), optimizer steps reach the generator without a copy, load_weights leaves them
    shared; a generator of another dtype does not share."""
    model = _trainer_model()
    gen = _generator(model, block_size=4, num_blocks=64)
    assert gen.share_weights(model)
    trainer_ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert {n: p.data_ptr() for n, p in gen.model.named_parameters()} == trainer_ptrs
    prompt = _prompts([7])[0]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for _ in range(3):
        model(torch.tensor([prompt])).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    gen.load_weights(model)
    assert {n: p.data_ptr() for n, p in gen.model.named_parameters()} == trainer_ptrs
    model.eval()
    (c,), _ = gen.generate([prompt], SamplingParams(max_new_tokens=10, temperature=0))
    assert c.token_ids == greedy_reference(model, prompt, 10)[0]
    bf16 = Generator(ARGS, GeneratorConfig(block_size=4, num_blocks=8), torch.device("cpu"), dtype=torch.bfloat16)
    assert not bf16.share_weights(model) and not bf16.shares_weights


def test_sleep_frees_the_pool_and_wake_restores_it():
    gen = _generator(_trainer_model(), block_size=4, num_blocks=32)
    # 32 blocks plus the scratch block that padding rows write into.
    expected = 33 * 4 * 2 * ARGS.n_layers * ARGS.n_kv_heads * ARGS.head_dim * 4
    assert gen.kv_cache_bytes == expected
    gen.sleep()
    assert gen.kv_cache_bytes == 0
    with pytest.raises(RuntimeError, match="sleeping generator"):
        gen.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    gen.wake()
    assert gen.kv_cache_bytes == expected
    gen.generate([[1, 2]], SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize(
    "prompts,params,pattern",
    [
        ([[]], SamplingParams(), "prompt 0 is empty"),
        ([[1] * 96], SamplingParams(), "prompt 0 has 96 tokens but the model context is 96"),
        ([[1]], SamplingParams(max_new_tokens=0), "max_new_tokens must be > 0"),
        ([[1]], SamplingParams(temperature=-1), "temperature must be >= 0"),
        ([[1]], SamplingParams(top_p=0), r"top_p must be in \(0, 1\]"),
        ([[1]], SamplingParams(n=0), "n must be >= 1"),
        ([[1000]], SamplingParams(), r"token ids outside \[0, 101\)"),
        ([[1]], SamplingParams(stop_strings=["x"]), "stop_strings need a tokenizer"),
    ],
)
def test_bad_input_is_a_clear_error(prompts, params, pattern):
    gen = _generator(_trainer_model(), block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match=pattern):
        gen.generate(prompts, params)


def test_pool_too_small_names_needed_size():
    """KV pool too small for one sequence -> ValueError naming the blocks and bytes needed"""
    gen = _generator(_trainer_model(), block_size=4, num_blocks=3)
    with pytest.raises(
        ValueError, match=r"has 3 blocks of 4 tokens, but prompt 0 with max_new_tokens=8 needs 4 blocks \(\d+ bytes\)"
    ):
        gen.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_new_tokens=8))


# ---- allocator properties ----


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["alloc", "fork", "free", "register", "lookup"]), st.integers(0, 50)), max_size=200
    )
)
def test_block_allocator_never_leaks_or_double_frees(ops):
    alloc = BlockAllocator(num_blocks=8)
    held: list[int] = []  # one entry per reference we own
    for op, x in ops:
        if op == "alloc":
            try:
                block = alloc.allocate()
            except OutOfBlocks:
                assert alloc.num_free == 0
                continue
            assert block not in held, "handed out a block in use"
            held.append(block)
        elif op == "fork" and held:
            held.append(alloc.fork(held[x % len(held)]))
        elif op == "free" and held:
            alloc.free(held.pop(x % len(held)))
        elif op == "register" and held:
            alloc.register(held[x % len(held)], block_hash=x % 5)
        elif op == "lookup":
            block = alloc.lookup(x % 5)
            if block is not None:
                held.append(block)
        alloc.check_invariants()
        for b in set(held):
            assert alloc.ref_count[b] == held.count(b)
    for b in held:
        alloc.free(b)
    alloc.check_invariants()
    assert alloc.num_free == 8 and all(rc == 0 for rc in alloc.ref_count)


def test_block_hashes_chain_prefixes():
    a = block_hashes(list(range(10)), 4)
    b = block_hashes([99] + list(range(1, 10)), 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # a change early changes every later hash
    assert block_hashes(list(range(8)), 4) == a


@pytest.mark.parametrize("seed", range(3))
def test_random_workloads_leave_no_block_behind(seed):
    model = _trainer_model()
    g = torch.Generator().manual_seed(seed)
    gen = _generator(model, block_size=4, num_blocks=int(torch.randint(10, 40, (1,), generator=g)))
    lengths = torch.randint(1, 20, (6,), generator=g).tolist()
    completions, stats = gen.generate(
        _prompts(lengths, seed), SamplingParams(max_new_tokens=15, temperature=1.0, n=3, seed=seed)
    )
    assert len(completions) == 18
    gen.allocator.check_invariants()
    assert all(rc == 0 for rc in gen.allocator.ref_count)
    assert gen.allocator.num_free == gen.num_blocks
    assert math.isfinite(stats.tokens_per_s)


def test_batch_invariant_mode_logprobs_bitwise_equal_trainer():
    """In batch-invariant mode the generator's logprobs equal the trainer's forward bit for bit,
    for sequences decoded among others of different lengths, with sharing and preemption."""
    from titanrl.models.batch_invariant import ExactCausalAttention, batch_invariant_mode

    model = _trainer_model()
    gen = _generator(model, block_size=4, num_blocks=14, batch_invariant=True)
    assert gen.attention == "exact"
    prompts = _prompts([5, 11, 3])
    completions, stats = gen.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0, n=2, seed=5))
    assert stats.preemptions > 0
    for c in completions:
        seq = prompts[c.prompt_index] + c.token_ids
        P = len(prompts[c.prompt_index])
        with torch.no_grad(), batch_invariant_mode():
            logits_BTV = model(torch.tensor([seq[:-1]]), backend=ExactCausalAttention())
        trainer_lp = token_logprobs(logits_BTV, torch.tensor([seq[1:]]))[0, P - 1 :]
        assert torch.equal(trainer_lp, torch.tensor(c.logprobs, dtype=torch.float32))
    # Without the mode, the same comparison is only close: the test can tell the difference.
    plain = _generator(model, block_size=4, num_blocks=14)
    completions, _ = plain.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0, n=2, seed=5))
    diffs = []
    for c in completions:
        seq = prompts[c.prompt_index] + c.token_ids
        P = len(prompts[c.prompt_index])
        with torch.no_grad():
            trainer_lp = token_logprobs(model(torch.tensor([seq[:-1]])), torch.tensor([seq[1:]]))[0, P - 1 :]
        diffs.append((trainer_lp - torch.tensor(c.logprobs)).abs().max().item())
    assert max(diffs) > 0


def test_weight_sync_invalidates_prefix_cache():
    """Cached prompt K/V from old weights must not be reused after load_weights."""
    model = _trainer_model()
    gen = _generator(model, block_size=4, num_blocks=64)
    prompt = _prompts([13])[0]
    gen.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    gen.load_weights(model)
    (c,), stats = gen.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0))
    assert stats.prefix_cache_hit_tokens == 0
    assert c.token_ids == greedy_reference(model, prompt, 8)[0]


@pytest.mark.parametrize("backend,attention", [("aot_eager", "gathered"), ("inductor", "flex")])
def test_compiled_decode_matches_and_does_not_recompile(backend, attention):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    model = _trainer_model()
    gen = _generator(model, block_size=4, num_blocks=128, compile=True, compile_backend=backend)
    assert gen.attention == attention
    params = SamplingParams(max_new_tokens=16, temperature=0)
    prompts = _prompts([3, 9, 17])  # decode batches of 3 -> bucket 8
    completions, stats = gen.generate(prompts, params)
    assert stats.compile_seconds > 0
    for c in completions:
        assert c.token_ids == greedy_reference(model, prompts[c.prompt_index], 16)[0]
    warm = counters["stats"]["unique_graphs"]
    assert warm >= 1
    # Other lengths, same bucket: context lengths are dynamic, so nothing compiles again.
    completions, stats = gen.generate(_prompts([5, 12, 21], seed=7), SamplingParams(max_new_tokens=20, temperature=0))
    assert counters["stats"]["unique_graphs"] == warm and stats.compile_seconds == 0
    for c in completions:
        assert c.token_ids == greedy_reference(model, _prompts([5, 12, 21], seed=7)[c.prompt_index], 20)[0]


def test_compile_decode_builds_the_cuda_graph_variant():
    """On CUDA the step is compiled with CUDA graphs. torch.compile refuses `mode` together with
    `options` (the guard filter), which the generator used to pass on CUDA: every compiled GPU
    run failed at start. Wrapping is lazy, so this runs without a GPU."""
    from titanrl.generator.decode import compile_decode, uses_cuda_graphs

    assert uses_cuda_graphs(True, "inductor", torch.device("cuda"))
    assert not uses_cuda_graphs(True, "aot_eager", torch.device("cuda"))
    assert not uses_cuda_graphs(True, "inductor", torch.device("cpu"))
    assert not uses_cuda_graphs(False, "inductor", torch.device("cuda"))
    model_fn, step_fn = compile_decode(_trainer_model(), "inductor", torch.device("cuda"))
    assert callable(model_fn) and callable(step_fn)
    with pytest.raises(RuntimeError, match="Either mode or options"):  # what the old call did
        torch.compile(lambda x: x, mode="reduce-overhead", options={"guard_filter_fn": None})


def test_cuda_graph_pool_is_static_so_the_decode_step_is_captured():
    """The decode step writes K/V into the pool in place; inductor's CUDA graphs skip a step that
    mutates non-static inputs (seen on an H200: every step ran without a graph). The pool's
    tensors are marked static addresses (unguarded: a new pool re-records, it does not recompile)."""
    from titanrl.generator.decode import static_kv_for_cuda_graphs

    k, v = [torch.zeros(4, 2, 3)], [torch.zeros(4, 2, 3)]
    static_kv_for_cuda_graphs(k, v)
    assert [getattr(t, "_dynamo_static_input_type", None) for t in (*k, *v)] == ["unguarded", "unguarded"]


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_sleep_returns_the_pool_memory_to_the_system():
    """Time-slicing: after sleep() the process's resident memory drops by (about) the pool size;
    wake() touches no page until blocks are used (they are zeroed when first handed out)."""
    gen = _generator(_trainer_model(), block_size=16, num_blocks=25_000)  # ~205 MB of K/V
    pool_bytes = gen.kv_cache_bytes
    assert pool_bytes > 150 * 2**20
    before = _resident_bytes()
    for block in range(gen.pool.num_blocks):  # a pool used to the last block
        gen.pool.prepare(block)
    awake = _resident_bytes()
    assert awake - before > 0.9 * pool_bytes
    gen.sleep()
    asleep = _resident_bytes()
    assert awake - asleep > 0.9 * pool_bytes
    gen.wake()
    assert _resident_bytes() - asleep < 0.1 * pool_bytes
    completions, _ = gen.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, n=2))
    assert len(completions) == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_freed_heap_memory_goes_back_to_the_system():
    """glibc keeps freed blocks below its (raised) mmap threshold in the heap; the sleep / wake
    hook hands them back, so freed activations do not stay resident between RL steps."""
    from titanrl.distributed.utils import return_freed_host_memory

    raise_threshold = torch.ones(30 * 2**20 // 4)  # a large free raises the mmap threshold
    del raise_threshold
    blocks = [torch.ones(2 * 2**20 // 4) for _ in range(64)]  # 128 MiB in 2 MiB heap blocks
    pin = torch.ones(2 * 2**20 // 4)  # above them: glibc's own trim of the heap top cannot reach them
    held = _resident_bytes()
    del blocks
    return_freed_host_memory()
    assert held - _resident_bytes() > 100 * 2**20
    del pin


def test_uninitialised_pool_memory_never_leaks_into_outputs():
    """Never-used KV-pool memory poisoned with NaN (the pool is allocated uninitialised) -> mixed-length greedy generation still equals the reference: blocks are zeroed when first handed out"""
    model = _trainer_model()
    gen = _generator(model, block_size=4, num_blocks=64)
    scratch = gen.pool.num_blocks - 1
    for t in gen.pool.k + gen.pool.v:
        t[:scratch].fill_(float("nan"))
    prompts = _prompts([3, 9, 14])
    completions, _ = gen.generate(prompts, SamplingParams(max_new_tokens=7, temperature=0.0))
    for c in completions:
        assert c.token_ids == greedy_reference(model, prompts[c.prompt_index], 7)[0]
        assert all(math.isfinite(lp) for lp in c.logprobs)


def test_rows_of_is_advanced_indexing_along_the_first_dimension():
    from titanrl.generator.kv_cache import rows_of

    pool = torch.randn(9, 4, 2, 3)
    for index in (torch.tensor([3, 0, 3]), torch.tensor([[1, 8], [0, 0], [5, 2]])):
        assert torch.equal(rows_of(pool, index), pool[index])
    flat, index = pool.view(36, 2, 3), torch.tensor([[35, 0]])
    assert torch.equal(rows_of(flat, index), flat[index])


def test_decode_pass_tables_hold_only_the_pages_a_step_can_reach():
    """A pass reserves pages for all its steps; step s attends over max(pos) + s at most, so its
    table is cut to the pages that reach that position (never fewer, never the masked tail)."""
    from titanrl.generator.decode import _TableWidths

    table_NM = torch.arange(2 * 7).view(2, 7)
    tables = _TableWidths(table_NM, max_pos=9, block_size=4, dynamic=False)
    for step in range(20):
        t = tables.at(step)
        reach = 9 + step
        assert t.shape[1] == min(7, max(2, reach // 4 + 1))
        assert t.shape[1] * 4 > min(reach, 7 * 4 - 1)  # the deepest position is covered
        assert t.is_contiguous() and torch.equal(t, table_NM[:, : t.shape[1]])
    assert tables.at(0) is tables.at(2)  # one copy per width


@pytest.mark.parametrize("free, steps, added", [(40, 32, 8), (10, 8, 2), (3, 1, 0)])
def test_reserve_ahead_halves_the_steps_until_the_free_blocks_cover_them(free, steps, added):
    """A pass reserves blocks for the steps of every running sample; where the pool cannot hold
    `decode_steps_per_schedule` of them it takes half, a quarter, ... (not one step at once)."""
    B, used = 4, 8
    config = GeneratorConfig(block_size=B, num_blocks=used + free)
    pool = KVCachePool(1, used + free, B, 1, 8, torch.float32, torch.device("cpu"))
    allocator = BlockAllocator(used + free)
    params = SamplingParams(max_new_tokens=64)
    sched = Scheduler(pool, allocator, config, [[1] * 8], [0], params, max_seq_len=96, vocab_size=100)
    # Four samples of 8 tokens (two full blocks each); the next token is fed at position 7.
    batch = [
        Seq(0, j, [1] * 8, 4, params, key=j, block_table=[allocator.allocate() for _ in range(2)]) for j in range(4)
    ]
    got, left = sched.reserve_ahead(batch, 32)
    assert (got, left) == (steps, [60] * 4)
    # Positions 7 .. 6 + steps are written: blocks up to (6 + steps) // B.
    assert [len(s.block_table) for s in batch] == [2 + added] * 4
    assert allocator.num_free == free - 4 * added
    assert all(s.block_table[-1] < used + free for s in batch)


def test_decode_passes_match_step_by_step_scheduling():
    """Several decode steps per scheduler pass (eos and length stops tested on device) give the
    same samples, logprobs and finish reasons as scheduling every step."""
    model = _trainer_model()
    prompts = _prompts([5, 11, 3, 17])
    params = SamplingParams(max_new_tokens=21, temperature=1.0, n=3, seed=4, stop_token_ids=[7, 19])
    runs = []
    for steps in (1, 32):
        completions, stats = _generator(model, block_size=4, num_blocks=256, decode_steps_per_schedule=steps).generate(
            prompts, params
        )
        runs.append((completions, stats))
    (a, sa), (b, sb) = runs
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    assert {c.finish_reason for c in a} == {"stop", "length"}
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)
    assert sa.decode_tokens == sb.decode_tokens and sa.steps == sb.steps
    assert sb.scheduler_passes < sa.scheduler_passes / 4
