"""The paged attention backends against a float64 reference: ragged packed prefill (chunks that
start mid-page, full pages, one-token rows), prefix pages shared between sequences, GQA with a
head ratio that is not a power of two, decode steps with dead rows; FlexAttention compiled (its
block mask built on device, inside the compiled region for the decode step), the gathered SDPA
path and the batch-invariant one. End-to-end equality with a full-recompute reference (ragged
batches, preemption and resume) is in test_generator.py."""

import pytest
import torch
from helpers.reference import paged_attention_reference

from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator.paged_attention import (
    PagedBatch,
    SeqSlice,
    attention_kinds,
    logical_page_index,
    paged_attention,
)

B, P, HKV, H, D = 4, 24, 2, 6, 16  # 3 query heads per KV head
SCRATCH = P - 1
# Sequences 0 and 1 share their first two pages (a group prompt / prefix-cache hit): same logical
# positions. Sequence 0 prefills a chunk that starts mid-page; 2 prefills three full pages; 3 is a
# one-token row at a page's first slot.
SEQS = [
    SeqSlice([3, 7, 1, 9], 4 * B - 1, 2 * B + 1),
    SeqSlice([3, 7, 12], 2 * B + 2, 2),
    SeqSlice([2, 10, 11], 3 * B, 3 * B),
    SeqSlice([5, 8], B + 1, 1),
]


def _pool(seed: int, nan: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pages; pages no table holds are NaN (`nan`): a backend that reads them poisons its output."""
    g = torch.Generator().manual_seed(seed)
    k_pages, v_pages = torch.randn(P, B, HKV, D, generator=g), torch.randn(P, B, HKV, D, generator=g)
    held = {b for s in SEQS for b in s.block_table} | {SCRATCH}
    for page in set(range(P)) - held if nan else ():
        k_pages[page], v_pages[page] = float("nan"), float("nan")
    return k_pages, v_pages


@pytest.mark.parametrize("kind", ["flex", "gathered", "exact"])
def test_prefill_matches_float64_on_ragged_batches_with_shared_pages(kind):
    """Packed new tokens of 4 sequences (chunks mid-page, full pages, shared prefix pages, GQA 3:1)
    -> within 1e-5 of a float64 softmax over each query's positions 0..pos; K/V land at the slots."""
    torch._dynamo.reset()  # FlexAttention compiled alone: fresh static shapes (see `attention_kinds`)
    k_pages, v_pages = _pool(0)
    g = torch.Generator().manual_seed(1)
    N = sum(s.num_new for s in SEQS)
    q, k, v = (torch.randn(1, N, h, D, generator=g) for h in (H, HKV, HKV))
    batch = PagedBatch.from_slices(SEQS, SCRATCH, B, torch.device("cpu"), num_pages=P if kind == "flex" else None)
    out = paged_attention(kind, batch, [k_pages], [v_pages]).attend(0, q, k, v)
    positions = [list(range(s.context_len - s.num_new, s.context_len)) for s in SEQS]
    slots = [s.block_table[p // B] * B + p % B for s, pos in zip(SEQS, positions) for p in pos]
    assert torch.equal(k_pages.view(-1, HKV, D)[slots], k[0]) and torch.equal(v_pages.view(-1, HKV, D)[slots], v[0])
    ref = paged_attention_reference(q[0], k_pages, v_pages, [s.block_table for s in SEQS], positions)
    torch.testing.assert_close(out[0].double(), ref, atol=1e-5, rtol=1e-5)


def _decode_step(kind, k_pages, v_pages, table, pos, live, page_index, q, k, v):
    batch = PagedBatch.decode(table, pos, live, SCRATCH, B, page_index)
    return paged_attention(kind, batch, [k_pages], [v_pages]).attend(0, q, k, v)


@pytest.mark.parametrize("kind", ["flex", "gathered", "exact"])
def test_decode_step_matches_float64_with_dead_rows(kind):
    """A decode step as the on-device loop runs it (FlexAttention: compiled as one region, the block
    mask built inside): rows at a page's first and last slots, shared pages, a dead row and a
    padding row write the scratch block; live rows within 1e-5 of float64."""
    k_pages, v_pages = _pool(2)
    table = torch.tensor([[3, 7, 1, 9], [3, 7, 12, SCRATCH], [2, 10, 11, SCRATCH], [SCRATCH] * 4])
    pos = torch.tensor([3 * B, 2 * B + 3, 2 * B + 1, 0])
    live = torch.tensor([True, True, False, False])
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, h, D, generator=g) for h in (H, HKV, HKV))
    step = torch.compile(_decode_step, fullgraph=True) if kind == "flex" else _decode_step
    page_index = logical_page_index(table, SCRATCH, P)
    before = k_pages.clone()
    out = step(kind, k_pages, v_pages, table, pos, live, page_index, q, k, v)
    assert torch.equal(k_pages[9, 0], k[0, 0]) and torch.equal(v_pages[12, 3], v[0, 1])  # live rows' slots
    assert torch.equal(k_pages[11], before[11]) and not torch.equal(
        k_pages[SCRATCH], before[SCRATCH]
    )  # dead rows -> scratch
    ref = paged_attention_reference(q[0, :2], k_pages, v_pages, table[:2].tolist(), [[int(p)] for p in pos[:2]])
    torch.testing.assert_close(out[0, :2].double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


def test_the_mask_alone_is_exact():
    """FlexAttention uncompiled evaluates the mask_mod on every slot of the pool, without the block
    mask's page lists: the mask alone must keep each query to its own sequence's positions."""
    from torch.nn.attention.flex_attention import flex_attention

    from titanrl.generator.paged_attention import fold_heads, page_block_mask, unfold_heads

    k_pages, v_pages = _pool(4, nan=False)
    g = torch.Generator().manual_seed(5)
    N = sum(s.num_new for s in SEQS)
    batch = PagedBatch.from_slices(SEQS, SCRATCH, B, torch.device("cpu"), num_pages=P)
    q = torch.randn(1, N, H, D, generator=g)
    q_SQHD = batch.queries(q)
    mask = page_block_mask(batch, H // HKV, B, P, pad_to_pool=False)
    kv = [t.view(1, P * B, HKV, D).transpose(1, 2) for t in (k_pages, v_pages)]
    out_SGXD = flex_attention(fold_heads(q_SQHD, HKV), *kv, block_mask=mask)
    out = batch.packed(unfold_heads(out_SGXD, q_SQHD.shape[1]), N)
    positions = [list(range(s.context_len - s.num_new, s.context_len)) for s in SEQS]
    ref = paged_attention_reference(q[0], k_pages, v_pages, [s.block_table for s in SEQS], positions)
    torch.testing.assert_close(out[0].double(), ref, atol=1e-5, rtol=1e-5)


def test_logical_page_index_gives_each_held_page_its_position():
    table = torch.tensor([[3, 7, 1], [3, 7, SCRATCH], [SCRATCH] * 3])
    index = logical_page_index(table, SCRATCH, P)
    assert index[[3, 7, 1, SCRATCH]].tolist() == [0, 1, 2, 0]
    assert index.dtype == torch.int32 and index.shape == (P,)


def test_attention_kinds_put_flex_wherever_it_compiles():
    """(compiled regions, eager forwards): FlexAttention everywhere on CUDA, compiled or not; on CPU
    in the compiled decode step only (eager CPU forwards use no compiler); batch-invariant mode and
    'exact' the exact attention; a non-inductor backend (debugging) the gathered pages."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto = GeneratorConfig()
    assert attention_kinds(auto, cuda, compile=True) == ("flex", "flex")
    assert attention_kinds(auto, cuda, compile=False) == ("flex", "flex")
    assert attention_kinds(auto, cpu, compile=True) == ("flex", "gathered")
    assert attention_kinds(auto, cpu, compile=False) == ("gathered", "gathered")
    assert attention_kinds(GeneratorConfig(compile_backend="aot_eager"), cuda, compile=True) == ("gathered",) * 2
    assert attention_kinds(GeneratorConfig(attention_impl="exact"), cuda, compile=False) == ("exact", "exact")
    assert attention_kinds(GeneratorConfig(batch_invariant=True), cuda, compile=False) == ("exact", "exact")


@pytest.mark.parametrize("old", ["sdpa", "flex", "inplace", "cpu_kernel"])
def test_removed_attention_impls_are_rejected_naming_the_new_ones(old):
    with pytest.raises(ValueError, match="'auto'.*'exact'"):
        GeneratorConfig(attention_impl=old).validate()
