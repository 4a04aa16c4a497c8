"""Routing replay's generator half: each MoE layer's experts for every token the generator feeds
to the model (prompt prefill, recomputation after preemption, decode steps), kept per sample as
chunks by position and handed back on the `Completion` (`Seq.assemble_routes`).

The generator records whenever the model has MoE layers, with prefix caching on as off: a prompt
block carries its tokens' routes (`block_routes`, block id -> [block_size, MoE layers, top_k],
kept for every full prompt block that a prefill computed, the blocks prefix caching registers),
and a prompt whose first blocks were found in the cache takes their routes from there: the
routes that produced the cached K/V. A group's samples share their prompt's blocks and routes."""

import torch

from titanrl.generator.sequence import Seq
from titanrl.models.args import TransformerModelArgs


def has_moe_layers(args: TransformerModelArgs) -> bool:
    return any(args.is_moe_layer(i) for i in range(args.n_layers))


def add_route_chunk(seq: Seq, start: int, routes_NLK: torch.Tensor) -> None:
    """`seq` fed positions start .. start + N - 1 through the model, routed as `routes_NLK`."""
    if seq.route_chunks is None:
        seq.route_chunks = []
    seq.route_chunks.append((start, routes_NLK.to(torch.int16).cpu()))


def record_packed_routes(seqs: list[Seq], starts: list[int], counts: list[int], routes_LNK: torch.Tensor) -> None:
    """A packed forward fed `counts[i]` tokens of `seqs[i]` from position `starts[i]`, one after
    the other (padding rows after them, if any, are ignored): cut `moe_routes()` back per sample."""
    routes_NLK = routes_LNK.transpose(0, 1).to(torch.int16).cpu()
    offset = 0
    for seq, start, n in zip(seqs, starts, counts):
        add_route_chunk(seq, start, routes_NLK[offset : offset + n])
        offset += n


def record_prefill_routes(
    seqs: list[Seq],
    starts: list[int],
    counts: list[int],
    routes_LNK: torch.Tensor,
    block_routes: dict[int, torch.Tensor],
    block_size: int,
) -> None:
    """After a packed prefill (as `record_packed_routes`): a group prompt that started at
    `start` > 0 on its first chunk found its first `start` tokens' blocks in the prefix cache and takes their routes
    from `block_routes`; then every sequence's full prompt blocks leave their routes there."""
    for seq, start in zip(seqs, starts):
        if seq.is_group_prompt and start > 0 and not seq.route_chunks:  # its first chunk (chunked prefill)
            hits = seq.block_table[: start // block_size]
            assert all(b in block_routes for b in hits), "a cached prompt block without recorded routes"
            add_route_chunk(seq, 0, torch.cat([block_routes[b] for b in hits]))
    record_packed_routes(seqs, starts, counts, routes_LNK)
    for seq in seqs:
        full = min(seq.num_computed, seq.prompt_len) // block_size
        routes_PLK = routes_of_positions(seq, full * block_size)
        for i, block in enumerate(seq.block_table[:full]):
            block_routes[block] = routes_PLK[i * block_size : (i + 1) * block_size]


def routes_of_positions(seq: Seq, n: int) -> torch.Tensor:
    """The routes recorded for positions 0 .. n - 1 of `seq` (later chunks win), [n, L, K]; a
    prefill has recorded every one of them."""
    routes_PLK = seq.routes_of_first(n)
    assert n == 0 or bool((routes_PLK >= 0).all()), "prompt positions without recorded routes"
    return routes_PLK
