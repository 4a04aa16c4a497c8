"""Per-sequence recurrent state of a hybrid model's linear-attention layers: the generator's
second kind of memory, beside the paged KV of its full-attention layers.

A gated DeltaNet layer keeps, per sequence, the last `kernel - 1` inputs of its convolution and
a [value heads, key dim, value dim] float32 matrix: fixed size whatever the sequence's length,
so a sequence holds one slot (all layers) from its first prefill chunk until it finishes. A
chunk of a long prompt continues from the state its earlier chunks left; a group prompt's
first sample takes over the prompt's slot and the others get copies (GRPO prefix sharing); a
preempted sequence lets go of its slot and recomputes its context into a fresh one. The last
slot is scratch (padding rows). Prefix caching of KV blocks is off for hybrid models: a cached
block's K/V would skip tokens whose recurrent state no slot holds.
"""

import torch

from titanrl.models.args import TransformerModelArgs
from titanrl.models.gated_deltanet import LinearStates, Segments


def _conv_dim(args: TransformerModelArgs) -> int:
    """Channels of a linear layer's convolution: q, k (key heads) and v (value heads)."""
    return (
        2 * args.linear_num_key_heads * args.linear_key_head_dim
        + args.linear_num_value_heads * args.linear_value_head_dim
    )


class StateSlots:
    """`num_slots` slots (+ scratch) of every linear layer's conv and recurrent state."""

    def __init__(
        self, args: TransformerModelArgs, num_slots: int, dtype: torch.dtype, device: torch.device, tp: int = 1
    ) -> None:
        """`tp`: each tensor-parallel rank holds its 1 / tp of the heads' states (whole key-head groups)."""
        conv_dim = _conv_dim(args) // tp
        K = args.linear_conv_kernel_dim
        heads, dk, dv = args.linear_num_value_heads // tp, args.linear_key_head_dim, args.linear_value_head_dim
        layers = [i for i in range(args.n_layers) if args.is_linear_layer(i)]
        self.conv = {i: torch.zeros(num_slots + 1, conv_dim, K - 1, dtype=dtype, device=device) for i in layers}
        self.recurrent = {
            i: torch.zeros(num_slots + 1, heads, dk, dv, dtype=torch.float32, device=device) for i in layers
        }
        self.scratch = num_slots
        self.device = device
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest

    @staticmethod
    def bytes_for(args: TransformerModelArgs, num_slots: int, dtype: torch.dtype, tp: int = 1) -> int:
        """`nbytes` of `StateSlots(args, num_slots, dtype, ..., tp)` (the scratch slot included)."""
        conv = _conv_dim(args) * (args.linear_conv_kernel_dim - 1) * torch.empty(0, dtype=dtype).element_size()
        recurrent = args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4
        n_linear = sum(map(args.is_linear_layer, range(args.n_layers)))
        return (num_slots + 1) * n_linear * (conv + recurrent) // tp

    @property
    def nbytes(self) -> int:
        tensors = [*self.conv.values(), *self.recurrent.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A slot holding the zero state (a sequence before its first token)."""
        assert self._free, "no free state slot: the scheduler admits at most max_num_seqs sequences"
        slot = self._free.pop()
        self.zero(slot)
        return slot

    def zero(self, slot: int) -> None:
        """The state before a sequence's first token."""
        for t in (*self.conv.values(), *self.recurrent.values()):
            t[slot].zero_()

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.scratch and slot not in self._free, f"bad free of state slot {slot}"
        self._free.append(slot)

    def release_all(self) -> None:
        """Every slot free again (the end of a `generate` call)."""
        self._free = list(range(self.scratch - 1, -1, -1))

    def copy(self, src: int, dst: int) -> None:
        for t in (*self.conv.values(), *self.recurrent.values()):
            t[dst].copy_(t[src])

    def states(self, slots: list[int], num_new: list[int]) -> LinearStates:
        """The `LinearStates` of a packed forward: sequence s feeds `num_new[s]` tokens from slot
        `slots[s]` (-1: a padding row, the scratch slot)."""
        starts = [sum(num_new[:s]) for s in range(len(num_new))]
        slot_S = torch.tensor([s if s >= 0 else self.scratch for s in slots], device=self.device)
        return LinearStates(Segments.from_lengths(starts, num_new, self.device), slot_S, self.conv, self.recurrent)
