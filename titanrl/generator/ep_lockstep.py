"""The generator with experts sharded over `ep` ranks: forwards in lockstep across the ep group.

Under expert parallelism every MoE layer's forward is a collective (`ExpertParallel`: its tokens
go to their experts' rank and back with all-to-all), so every rank of the ep group must run each
MoE layer the same number of times, in the same order. But ep ranks are data-parallel ranks: each
generates its own prompts, with its own lengths, and its scheduler admits, decodes, preempts and
finishes on its own. SGLang's pattern for data-parallel attention with expert parallelism keeps
them in step: a rank with nothing to run joins its peers' MoE collectives with a forward over
zero tokens.

The protocol, one `all_reduce(MAX)` of a flag on the ep group ("tick") per forward:
- before each real forward (a prefill, a decode step) a rank ticks `FORWARD`; the maximum is then
  `FORWARD` on every rank, so every rank runs one forward: its real one, or an idle one (each MoE
  layer in layer order over zero tokens: the same all-to-alls, no attention, no KV);
- at the end of each scheduler pass (and before the first) a rank ticks `PASS_END` while it
  still has work, `DONE` when it has none, and repeats while a peer's tick was `FORWARD` (running
  an idle forward each time). When the maximum is below `FORWARD` every rank stands at a pass
  boundary; a maximum of `DONE` ends `generate` on every rank, else all go on (a rank without
  work only ticks).

A `generate` call starts with one more all-reduce (`agree`): a rank whose call is refused (bad
prompts) tells its peers, and all raise instead of the peers waiting for it forever.

Ticks are matched because every rank ticks in the same sequence: one tick per forward of the
rank that runs most, then one boundary tick. Without expert parallelism the generator makes no
tick and no extra collective. Weight sync copies each rank's own expert shard (the trainer's
experts are sharded over the same ep ranks): no rank gathers all experts.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titanrl.models.model import Transformer

DONE, PASS_END, FORWARD = 0, 1, 2


class EPLockstep:
    """Keeps the ep ranks' generator forwards matched (see the module doc)."""

    def __init__(self, model: Transformer, ep_mesh: DeviceMesh, device: torch.device) -> None:
        self.moe_layers = list(model.moe_layers())
        self.dim = model.args.dim
        self.group = ep_mesh.get_group()
        self.device = device
        self.idle_forwards = 0
        """Forwards over zero tokens run for peers (a count, for tests and stats)."""

    def _tick(self, flag: int) -> int:
        flag_1 = torch.tensor([flag], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag_1, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag_1.item())

    def agree(self, ok: bool) -> None:
        """Before a `generate` call's first tick: if any rank refused its call (a ValueError on
        its prompts), every rank stops instead of waiting for that rank's forwards."""
        if self._tick(int(not ok)) and ok:
            raise ValueError(
                "generate() was refused on another ep rank (its error names the cause); the ep ranks "
                "generate in lockstep, so this rank stops too"
            )

    def before_forward(self) -> None:
        """Called right before each real forward of this rank."""
        assert self._tick(FORWARD) == FORWARD

    def more_passes(self, has_work: bool) -> bool:
        """At a pass boundary: serve peers' forwards until all stand here; whether any has work."""
        while True:
            top = self._tick(PASS_END if has_work else DONE)
            if top < FORWARD:
                return top == PASS_END
            self.idle_forward()

    @torch.no_grad()
    def idle_forward(self) -> None:
        """Each MoE layer over zero tokens: this rank's share of a peer's forward collectives."""
        dtype = self.moe_layers[0].router.gate.weight.dtype
        x_10D = torch.zeros(1, 0, self.dim, dtype=dtype, device=self.device)
        for moe in self.moe_layers:
            moe(x_10D)
        self.idle_forwards += 1


def with_tick(step_fn, lockstep: EPLockstep):
    """`step_fn` (one decode step) preceded by a `FORWARD` tick."""

    def step(*args, **kwargs):
        lockstep.before_forward()
        return step_fn(*args, **kwargs)

    return step
