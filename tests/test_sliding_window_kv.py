"""Sliding-window layers' KV pages (`generator/window_pages.py`) on a tiny gpt-oss checkpoint
(window 8, blocks of 4, layers sliding / full alternately): between scheduler passes a decoding
sample holds at most window // block_size + 1 window pages while its full-attention table grows,
released pages go back to the allocator and are handed out again, and the greedy tokens and
logprobs still equal transformers' under GRPO groups, prefix-cache hits, chunked prefill,
preemption and multi-turn resumes; the paged backends read a window layer from its own pool."""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_gpt_oss import VOCAB, WINDOW, _reference_attention, _tiny_hf  # noqa: E402

from titanrl.config.generation import Generator as GeneratorConfig  # noqa: E402
from titanrl.generator import Generator, SamplingParams  # noqa: E402
from titanrl.generator.paged_attention import PagedBatch, SeqSlice, paged_attention  # noqa: E402
from titanrl.generator.scheduler import Scheduler  # noqa: E402
from titanrl.models.hf import read_hf_config  # noqa: E402

B = 4
BOUND = WINDOW // B + 1
"""Window pages of a decoding sample: its next query at p reads positions p - WINDOW + 1 .. p,
which span WINDOW // B + 1 blocks when p - WINDOW + 1 is not block-aligned (B divides WINDOW;
in general ceil(WINDOW / B) + 1)."""
PROMPT_LENGTHS = (30, 5, 21, 13)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    model = _tiny_hf(0.02)
    folder = tmp_path_factory.mktemp("gpt_oss_window")
    model.save_pretrained(folder)
    return model, folder


def _generator(folder, **config) -> Generator:
    # A short context keeps the window pool small (`window_pool_blocks`: 8 samples of 4 pages,
    # 16 for a whole context): 8 samples of up to 46 tokens would need ~90 pages without release.
    args = dataclasses.replace(read_hf_config(str(folder)), max_seq_len=64)
    config = dict(block_size=B, num_blocks=256, max_num_seqs=8, decode_steps_per_schedule=4) | config
    gen = Generator(args, GeneratorConfig(**config), torch.device("cpu"))
    gen.load_hf(str(folder))
    return gen


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _run_checked(gen: Generator, monkeypatch, params: SamplingParams, turns=None):
    """`generate`, checking the window tables of the running samples at every scheduler pass
    (before its admissions: between two passes). Returns completions, stats, the longest full
    table seen and how many window pages were handed out."""
    window = gen.window_pages
    assert window is not None
    seen = {"full": 0, "allocated": 0, "prefilling": 0}
    admit, allocate = Scheduler.admit, window.allocator.allocate

    def checked_admit(sched):
        for seq in sched.running + sched.prefilling:  # decoding, or between two prefill chunks
            assert window.held(seq) <= BOUND, (seq.num_computed, seq.window_table)
            seen["full"] = max(seen["full"], len(seq.block_table))
        seen["prefilling"] += len(sched.prefilling)
        window.allocator.check_invariants()
        return admit(sched)

    def counted_allocate():
        seen["allocated"] += 1
        return allocate()

    monkeypatch.setattr(Scheduler, "admit", checked_admit)
    monkeypatch.setattr(window.allocator, "allocate", counted_allocate)
    completions, stats = gen.generate(_prompts(), params, turns=turns)
    return completions, stats, seen


def _assert_matches_transformers(hf_model, prompts, completions, n):
    """Greedy tokens are the argmax of transformers' logits given everything before them, and
    the logprobs within 1e-4 of its log-softmax (one right-padded forward for all samples)."""
    fed = [p + c.token_ids[:-1] for p, c in zip([p for p in prompts for _ in range(n)], completions, strict=True)]
    tokens_BT = torch.zeros(len(fed), max(map(len, fed)), dtype=torch.long)
    for row, ids in zip(tokens_BT, fed):
        row[: len(ids)] = torch.tensor(ids)
    with torch.no_grad():
        logprobs_BTV = torch.log_softmax(hf_model(input_ids=tokens_BT).logits, -1)
    for b, completion in enumerate(completions):
        prompt_len = len(prompts[b // n])
        ref_LV = logprobs_BTV[b, prompt_len - 1 : len(fed[b])]
        assert len(completion.token_ids) == NEW_TOKENS
        assert completion.token_ids == ref_LV.argmax(-1).tolist(), b
        ref = ref_LV.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        assert (torch.tensor(completion.logprobs, dtype=torch.float64) - ref).abs().max() < 1e-4


@pytest.mark.parametrize(
    "config",
    [
        dict(),  # whole prompts at once, GRPO pairs sharing their prompt's pages; then prefix-cache hits
        dict(max_num_batched_tokens=12),  # chunked prefill: pages released between chunks
        dict(num_blocks=32),  # a small pool: preemption and recompute
    ],
    ids=["plain", "chunked", "preempting"],
)
def test_window_pages_stay_bounded_and_generation_matches_transformers(hf_folder, monkeypatch, config):
    hf_model, folder = hf_folder
    gen = _generator(folder, **config)
    window = gen.window_pages
    assert window is not None and gen.window_blocks == min(gen.num_blocks, 48)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, n=2)
    completions, stats, seen = _run_checked(gen, monkeypatch, params)
    _assert_matches_transformers(hf_model, _prompts(), completions, n=2)
    # Full-attention layers keep every page: the longest table covers the longest sample.
    assert seen["full"] >= (max(PROMPT_LENGTHS) + NEW_TOKENS - 1) // B
    # Released pages are handed out again: more pages taken than the pool has, all back at the end.
    assert seen["allocated"] > gen.window_blocks
    assert window.allocator.num_free == gen.window_blocks
    if "num_blocks" in config:
        assert stats.preemptions > 0
    else:
        assert stats.preemptions == 0
    if "max_num_batched_tokens" in config:
        assert stats.prefill_chunks > 0 and seen["prefilling"] > 0
    if config:
        return
    # Again: prefix-cache hits over the cached full and window pages of the same prompts.
    again, stats, _ = _run_checked(gen, monkeypatch, params)
    assert stats.prefix_cache_hit_tokens > 0
    assert [c.token_ids for c in again] == [c.token_ids for c in completions]


def test_window_layers_take_their_own_smaller_pool(hf_folder):
    """Half the layers sliding: the main pool's page holds the full layers only, and the window
    pool has far fewer pages; `kv_cache_bytes` counts both."""
    _, folder = hf_folder
    gen = _generator(folder)
    args = gen.args
    full_layers = sum(args.layer_window(i) == 0 for i in range(args.n_layers))
    assert 0 < full_layers < args.n_layers
    per_layer_page = 2 * B * args.n_kv_heads * args.head_dim * 4  # K and V, float32
    assert gen._bytes_per_block() == full_layers * per_layer_page
    window_layers = args.n_layers - full_layers
    expected = (gen.num_blocks + 1) * full_layers + (gen.window_blocks + 1) * window_layers
    assert gen.kv_cache_bytes == expected * per_layer_page


@pytest.mark.parametrize("kind", ["flex", "gathered", "exact"])
def test_backends_read_a_window_layer_from_its_own_pool(kind):
    """A sliding layer attends over the window batch (its pool, window tables whose released
    entries are the scratch block, here full of large garbage) and matches the float64
    reference; the main batch, over another pool, is not read."""
    Pw, P, Hkv, H, D, window = 8, 16, 2, 6, 8, 5
    scr = Pw - 1
    # Decode at 18 (keys 14..18), a 2-token step at 8, 9 and a 5-token chunk at 8..12 (keys from 4).
    tables = [[scr, scr, scr, 2, 5], [scr, 1, 4], [scr, 6, 3, 0]]
    lens_new = [(4 * B + 3, 1), (2 * B + 2, 2), (3 * B + 1, 5)]
    window_seqs = [SeqSlice(t, c, n) for t, (c, n) in zip(tables, lens_new)]
    main_seqs = [SeqSlice(list(range(i * 5, i * 5 + 5)), c, n) for i, (c, n) in enumerate(lens_new)]
    g = torch.Generator().manual_seed(0)
    k_pages, v_pages = torch.randn(Pw, B, Hkv, D, generator=g), torch.randn(Pw, B, Hkv, D, generator=g)
    k_pages[scr], v_pages[scr] = 1e4, -1e4
    N = sum(n for _, n in lens_new)
    q, k, v = (torch.randn(1, N, h, D, generator=g) for h in (H, Hkv, Hkv))
    sinks_H = 2 * torch.randn(H, generator=g)
    cpu = torch.device("cpu")
    main = PagedBatch.from_slices(main_seqs, P - 1, B, cpu, num_pages=P if kind == "flex" else None)
    window_batch = PagedBatch.from_slices(window_seqs, scr, B, cpu, num_pages=Pw if kind == "flex" else None)
    backend = paged_attention(kind, main, [k_pages], [v_pages], window_batch)
    out = backend.attend(0, q, k, v, sinks_H=sinks_H, window=window)
    positions = [list(range(c - n, c)) for c, n in lens_new]
    ref = _reference_attention(q[0], k_pages, v_pages, tables, positions, sinks_H, window)
    torch.testing.assert_close(out[0].double(), ref, atol=1e-5, rtol=1e-5)


class _Observation:
    """A multi-turn environment: the first turn's answer gets an observation longer than the
    window (the sample keeps its pages meanwhile), the second ends the episode."""

    def __init__(self) -> None:
        self.turns: dict[tuple[int, int], int] = {}
        self.ready: list[tuple[tuple[int, int], list[int] | None]] = []

    def submit(self, key, turn_token_ids, finish_reason) -> None:
        self.turns[key] = self.turns.get(key, 0) + 1
        obs = [(11 * key[0] + 3 * key[1] + i) % VOCAB for i in range(WINDOW + 3)]
        self.ready.append((key, obs if self.turns[key] == 1 else None))

    def poll(self, block: bool):
        ready, self.ready = self.ready, []
        return ready


def test_multi_turn_samples_resume_over_their_window_pages(hf_folder, monkeypatch):
    """A resumed sample extends its window table (its kept pages and the observation's) and
    its model tokens stay transformers' greedy choices given everything before them."""
    hf_model, folder = hf_folder
    gen = _generator(folder)
    params = SamplingParams(max_new_tokens=5, temperature=0, n=2)
    completions, stats, _ = _run_checked(gen, monkeypatch, params, turns=_Observation())
    assert stats.resumed_turns == 2 * len(PROMPT_LENGTHS)
    prompts = [p for p in _prompts() for _ in range(2)]
    full = [p + c.token_ids for p, c in zip(prompts, completions, strict=True)]
    tokens_BT = torch.zeros(len(full), max(map(len, full)), dtype=torch.long)
    for row, ids in zip(tokens_BT, full):
        row[: len(ids)] = torch.tensor(ids)
    with torch.no_grad():
        logprobs_BTV = torch.log_softmax(hf_model(input_ids=tokens_BT).logits, -1)
    for b, (prompt, c) in enumerate(zip(prompts, completions)):
        assert c.model_mask is not None and sum(c.model_mask) == 10
        for i, (token, lp, own) in enumerate(zip(c.token_ids, c.logprobs, c.model_mask)):
            if own:
                ref_V = logprobs_BTV[b, len(prompt) + i - 1]
                assert token == ref_V.argmax().item(), (b, i)
                assert abs(lp - ref_V[token].item()) < 1e-4
    assert gen.window_pages is not None and gen.window_pages.allocator.num_free == gen.window_blocks
