"""Routing replay's generator half: each MoE layer's experts for every token the generator feeds
to the model (prompt prefill, recomputation after preemption, decode steps), kept per sample as
chunks by position and handed back on the `Completion` (`Seq.assemble_routes`).

The generator records whenever the model has MoE layers, and then runs without prefix caching:
a prompt whose blocks were found in the cache would have no routes for those tokens (the group's
samples still share their prompt's blocks and its routes)."""

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
