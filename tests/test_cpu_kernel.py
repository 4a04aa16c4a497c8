"""The hand-written CPU decode-attention kernel (`titanrl/generator/cpu_kernel.py`): against a
float64 reference over ragged rows and shared pages, inside the generator (eager and compiled)
against the full-recompute reference, and its fallbacks where it cannot run."""

import copy
import os
import shutil

import pytest
import torch
from helpers.reference import greedy_reference, paged_decode_attention_reference

from titanrl.config.rl_sections import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams, cpu_kernel
from titanrl.models import Transformer, TransformerModelArgs
from titanrl.models.logprobs import token_logprobs

CPU = torch.device("cpu")
# Skipped only where it cannot run by design; on an AVX-512 machine with a compiler, a kernel
# that no longer builds fails these tests instead of silently falling back.
_CAN_RUN = torch.backends.cpu.get_cpu_capability() == "AVX512" and shutil.which(os.environ.get("CC", "cc").split()[0])
needs_kernel = pytest.mark.skipif(not _CAN_RUN, reason="the CPU kernel needs AVX-512 and a C compiler")


def _forget_builds() -> None:
    cpu_kernel._library.cache_clear()
    cpu_kernel._build_error.cache_clear()


def _attend(threads: int, *args) -> torch.Tensor:
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return cpu_kernel.paged_decode_attention(*args)
    finally:
        torch.set_num_threads(threads_before)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block,head_dim,G,R", [(16, 16, 1, 2), (16, 64, 2, 2), (32, 64, 2, 3), (16, 128, 1, 4)])
def test_kernel_matches_float64_reference(block, head_dim, G, R, dtype):
    """float32: within 2e-6 x the score scale of float64. bfloat16 (pages and queries as stored,
    computed in float32, rounded once): within one bfloat16 rounding of the float64 result."""
    g = torch.Generator().manual_seed(block + head_dim + R)
    M = 4
    # Positions at and around page edges (and 16-lane edges inside pages of 32), the first
    # position, the last the table covers.
    pos_N = torch.tensor([0, block - 1, block, block + 1, 2 * block - 1, M * block - 1, 5, 3 * block + 2, 1, 15, 47])
    N = len(pos_N)
    pages = N * M + 1
    table_NM = torch.randperm(pages, generator=g)[: N * M].view(N, M).contiguous()
    table_NM[1, 0] = table_NM[2, 0]  # two rows share a prompt page (GRPO groups do)
    k_pages = torch.randn(pages, G, head_dim, block, generator=g)
    v_pages = torch.randn(pages, block, G, head_dim, generator=g)
    q_NGRD = torch.randn(N, G, R, head_dim, generator=g)
    # Slots past a row's position hold large values in its last page: masking must drop them.
    last = table_NM[0, 0]
    k_pages[last, :, :, 1:], v_pages[last, 1:] = 1e4, 1e4
    k_pages, v_pages, q_NGRD = k_pages.to(dtype), v_pages.to(dtype), q_NGRD.to(dtype)
    for scale in (1.0, 40.0):  # scores O(1), and peaked ones (softmax must subtract the max)
        args = (q_NGRD * scale, k_pages, v_pages, table_NM, pos_N)
        out = _attend(1, *args)
        ref = paged_decode_attention_reference(*args)
        assert out.dtype == dtype and out.shape == q_NGRD.shape
        err = (out.double() - ref).abs()
        if dtype == torch.float32:
            assert err.max().item() < 2e-6 * scale
        else:  # one rounding to 8 significant bits (at most 2^-8 relative), plus float32's error
            assert (err <= ref.abs() * 2**-8 + 2e-6 * scale).all(), err.max().item()
            assert (err > 0).any()  # the output is rounded: the check above is not vacuous
        assert torch.equal(_attend(2, *args), out)  # rows in parallel, each in a fixed order
    # Row 0 sees one position: its output is that position's value row.
    assert torch.allclose(out[0], v_pages[last, 0][:, None, :].expand(G, R, head_dim), atol=1e-6)
    # A NaN query gives NaN, as in the reference, in its row only.
    q_NGRD[3] = float("nan")
    out_nan = _attend(1, q_NGRD, k_pages, v_pages, table_NM, pos_N)
    assert out_nan[3].isnan().all() and not out_nan[torch.arange(N) != 3].isnan().any()


ARGS = TransformerModelArgs(
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


def _model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    return model.eval()


def _kernel_calls(prof) -> int:
    return sum(e.count for e in prof.key_averages() if e.key == "titanrl::paged_decode_attention")


@needs_kernel
@pytest.mark.parametrize("compile,top_logprobs", [(False, 0), (True, 0), (False, 2)])
def test_generator_with_the_kernel_matches_full_recompute_reference(compile, top_logprobs, monkeypatch):
    """Greedy decoding through the kernel (head_dim 16, GQA 2:1, pages of 16, a small pool with
    preemption) gives the reference's tokens and logprobs (1e-5): the on-device decode pass
    eager and compiled (from any bucket), and the one-step path that top logprobs take."""
    monkeypatch.setattr(cpu_kernel, "MIN_COMPILED_BUCKET", 1)
    torch._dynamo.reset()
    model = _model()
    config = GeneratorConfig(block_size=16, num_blocks=12, attention_impl="cpu_kernel", compile=compile)
    gen = Generator(ARGS, config, CPU)
    gen.load_weights(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (3, 17, 31, 9)]
    with torch.profiler.profile() as prof:
        completions, stats = gen.generate(
            prompts, SamplingParams(max_new_tokens=40, temperature=0, n=2, num_top_logprobs=top_logprobs)
        )
    assert _kernel_calls(prof) >= stats.decode_steps * ARGS.n_layers > 0  # every decode step, every layer
    assert stats.preemptions > 0
    for c in completions:
        ref_ids, ref_lps = greedy_reference(model, prompts[c.prompt_index], 40)
        assert c.token_ids == ref_ids
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref_lps)) < 1e-5
    if compile:  # other lengths, same buckets: the op's shapes are dynamic, nothing compiles again
        from torch._dynamo.utils import counters

        warm = counters["stats"]["unique_graphs"]
        more = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (5, 12, 21, 8)]
        completions, _ = gen.generate(more, SamplingParams(max_new_tokens=30, temperature=0, n=2))
        assert counters["stats"]["unique_graphs"] == warm
        assert all(c.token_ids == greedy_reference(model, more[c.prompt_index], 30)[0] for c in completions)


@needs_kernel
@pytest.mark.parametrize("compile", [False, True])
def test_bfloat16_generator_decodes_through_the_kernel_as_the_trainer_scores(compile, monkeypatch):
    """A bfloat16 generator decodes through the kernel at every step and layer, and the logprobs
    of its greedy tokens are the bfloat16 trainer's teacher-forced ones to within 0.02 (seen:
    7.7e-3), like the compiled PyTorch attention's; the eager 'sdpa' path runs the trainer's own
    SDPA and agrees to 1e-3 (seen: 9e-5), which is why 'auto' keeps it for eager bfloat16."""
    monkeypatch.setattr(cpu_kernel, "MIN_COMPILED_BUCKET", 1)
    torch._dynamo.reset()
    model = _model()
    trainer = copy.deepcopy(model).to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (3, 17, 31, 9)]
    errors = {}
    for impl in ("cpu_kernel", "sdpa", "auto"):
        config = GeneratorConfig(block_size=16, num_blocks=64, attention_impl=impl, compile=compile)
        gen = Generator(ARGS, config, CPU, dtype=torch.bfloat16)
        gen.load_weights(model)
        with torch.profiler.profile() as prof:
            completions, stats = gen.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0, n=2))
        if impl == "cpu_kernel" or (impl == "auto" and compile):
            assert _kernel_calls(prof) >= stats.decode_steps * ARGS.n_layers > 0
        else:
            assert _kernel_calls(prof) == 0
        errors[impl] = 0.0
        for c in completions:
            prompt = prompts[c.prompt_index]
            with torch.no_grad():
                logits = trainer(torch.tensor([prompt + c.token_ids]))[0, len(prompt) - 1 : -1]
            ref = token_logprobs(logits[None], torch.tensor([c.token_ids]))[0]
            errors[impl] = max(errors[impl], (torch.tensor(c.logprobs) - ref).abs().max().item())
    assert max(errors.values()) < 0.02, errors
    if not compile:
        assert errors["sdpa"] < 1e-3, errors


def test_auto_falls_back_and_an_explicit_request_says_why(tmp_path, monkeypatch):
    """'auto' uses the kernel only where it runs; asking for it where it cannot fails at start
    naming the cause. A missing compiler or an unwritable cache folder are causes too (a fresh
    cache folder forces a build)."""

    def use(dtype=torch.float32, **config):
        return cpu_kernel.use_for_decode(GeneratorConfig(**{"block_size": 16, **config}), CPU, dtype, 16)

    assert not use(torch.float16)
    assert not use(block_size=4)
    assert not use(attention_impl="cpu_kernel", batch_invariant=True)  # batch-invariant: the exact attention
    assert not use(attention_impl="inplace")
    assert use() == use(torch.bfloat16, compile=True) == bool(_CAN_RUN)
    assert not use(torch.bfloat16)  # eager bfloat16: the trainer's own SDPA (see the test above)
    with pytest.raises(ValueError, match=r"'cpu_kernel' cannot run here: it runs float32 or bfloat16 on CPU"):
        use(torch.float16, attention_impl="cpu_kernel")
    with pytest.raises(ValueError, match=r"block_size \(4\) and head_dim \(16\) must be multiples of 16"):
        Generator(ARGS, GeneratorConfig(block_size=4, num_blocks=8, attention_impl="cpu_kernel"), CPU)
    if not _CAN_RUN:
        return
    monkeypatch.setenv("TITANRL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    _forget_builds()
    try:
        assert cpu_kernel.unusable_reason(CPU, torch.float32, 16, 16) == "no C compiler ($CC or cc) to build it"
        monkeypatch.delenv("CC")
        (tmp_path / "a-file").write_text("")
        monkeypatch.setenv("TITANRL_CACHE", str(tmp_path / "a-file"))  # not a folder: no build, no crash
        _forget_builds()
        reason = cpu_kernel.unusable_reason(CPU, torch.float32, 16, 16)
        assert "could not be built or loaded" in reason and "$TITANRL_CACHE names a writable folder" in reason
        assert not cpu_kernel.use_for_decode(GeneratorConfig(block_size=16), CPU, torch.float32, 16)
        monkeypatch.setenv("TITANRL_CACHE", str(tmp_path))
        _forget_builds()
        assert cpu_kernel.unusable_reason(CPU, torch.float32, 16, 16) is None  # built into the cache folder
        assert len(list((tmp_path / "kernels").glob("paged_decode_attention_*.so"))) == 1
    finally:
        _forget_builds()
