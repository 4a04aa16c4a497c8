"""Routing replay's trainer half and the MoE metrics of an RL step.

The generator records each MoE layer's experts for every token it feeds to the model
(`generator/routes.py`); `routes_batch` lays them out beside the training batch's tokens as
batch["routes"] [B, T-1, MoE layers, top_k] (input position j of row b; -1 where none was
recorded), so that mini-batch and micro-batch splits, padding trims and packing carry them like
every other per-token field. With `[moe] routing_replay = "rollout"` the logprob and update
passes route by them (`data.batch_forward.forward_logprobs(replay_routes=True)`).

`MoEMonitor` reads, after each update forward, the experts the trainer used, its routers'
probabilities and the auxiliary loss, over the tokens the generator recorded, and gives the
step's metrics: the share of (token, layer) decisions on which generator and trainer chose
different experts (0 with replay; 0 without it in batch-invariant mode), per-layer load (most
loaded expert's tokens over the mean), the routers' mean entropy and the auxiliary loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

from titanrl.data.batch_forward import routes_in_rows
from titanrl.data.packing import layout_of
from titanrl.generator import Completion
from titanrl.models.model import Transformer
from titanrl.models.moe import TopKRouter


def routes_batch(prompt_lens: list[int], completions: list[Completion], T: int) -> torch.Tensor | None:
    """The completions' recorded routes as a [B, T-1, L, K] int16 batch field (None: a dense model)."""
    if not completions or completions[0].routes is None:
        return None
    _, L, K = completions[0].routes.shape
    routes_BTLK = torch.full((len(completions), T - 1, L, K), -1, dtype=torch.int16)
    for b, c in enumerate(completions):
        assert c.routes is not None, "every completion of a MoE rollout records routes"
        assert len(c.routes) == prompt_lens[b] + len(c.token_ids) - 1, "one route row per fed token"
        routes_BTLK[b, : len(c.routes)] = c.routes
    return routes_BTLK


class MoEMonitor:
    """Sums of one step's MoE statistics over the update forwards of `model` (see module doc)."""

    def __init__(self, model: Transformer) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.num_experts = self.routers[0].gate.weight.shape[0] if self.routers else 0
        self._probs: dict[int, torch.Tensor] = {}
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._keep_probs(i))
        self.reset()

    def _keep_probs(self, i: int):
        def hook(module, args, output) -> None:
            self._probs[i] = output[2].detach()  # [T, E]: autograd keeps it anyway

        return hook

    def reset(self) -> None:
        self.loads_LE: torch.Tensor | None = None
        """[MoE layers, experts] tokens per expert, float64 on the model's device (so that
        `observe` never waits for the device: one copy to the host per step, in `metrics`)."""
        self.sums: torch.Tensor | None = None
        """Decisions, disagreements, entropy, aux loss, forwards (float64, the model's device)."""

    @torch.no_grad()
    def observe(self, model: Transformer, batch: TensorDict, packing: str = "off") -> None:
        """After a forward of `model` over `batch`, padded or packed as `forward_logprobs` ran it
        with this `packing`. Tokens without recorded routes weigh 0 (no boolean indexing: its
        data-dependent shape would make the host wait for the device every micro-batch)."""
        if not self.routers or "routes" not in batch.keys():
            return
        trainer_NLK = model.moe_routes().transpose(0, 1)
        device = trainer_NLK.device
        if self.sums is None:
            self.loads_LE = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64, device=device)
            self.sums = torch.zeros(5, dtype=torch.float64, device=device)
        gen_NLK = routes_in_rows(batch["routes"], layout_of(batch, packing)).to(device, non_blocking=True)
        N, L, K = gen_NLK.shape
        valid_N = (gen_NLK >= 0).all(-1).all(-1).double()
        differ_NL = (trainer_NLK.sort(-1).values != gen_NLK.sort(-1).values).any(-1)
        probs_LNE = torch.stack([self._probs[i].double() for i in range(L)])
        entropy_LN = -(probs_LNE * probs_LNE.clamp_min(1e-30).log()).sum(-1)
        experts_LM = trainer_NLK.permute(1, 0, 2).reshape(L, N * K).long().clamp_min(0)
        assert self.loads_LE is not None
        self.loads_LE.scatter_add_(1, experts_LM, valid_N.repeat_interleave(K).expand(L, -1).contiguous())
        aux = model.moe_aux_loss().detach().double().reshape(())
        self.sums += torch.stack(
            [
                valid_N.sum() * L,
                (differ_NL.double() * valid_N[:, None]).sum(),
                (entropy_LN * valid_N).sum(),
                aux,
                torch.ones((), dtype=torch.float64, device=device),
            ]
        )

    def metrics(self, dp_group: dist.ProcessGroup | None) -> dict[str, float]:
        """The step's metrics, summed over data-parallel ranks (collective), then reset."""
        if not self.routers:
            return {}
        L, E = len(self.routers), self.num_experts
        if self.sums is None:  # no forward saw routes on this rank: zeros, for its peers' all-reduce
            flat = torch.zeros(5 + L * E, dtype=torch.float64)
        else:
            assert self.loads_LE is not None
            flat = torch.cat([self.sums, self.loads_LE.flatten()]).cpu()
        if dp_group is not None:
            dist.all_reduce(flat, group=dp_group)
        decisions, disagree, entropy, aux, forwards = flat[:5].tolist()
        loads_LE = flat[5:].view(L, E)
        load_L = (loads_LE.max(-1).values / loads_LE.mean(-1).clamp_min(1e-30)).tolist()
        self.reset()
        out = {
            "moe_route_disagree": disagree / max(decisions, 1.0),
            "moe_router_entropy": entropy / max(decisions, 1.0),
            "moe_aux_loss": aux / max(forwards, 1.0),
            "moe_load_max_mean": sum(load_L) / len(load_L),
        }
        out.update({f"moe_load_max_mean_l{i}": v for i, v in enumerate(load_L)})
        return out
