"""Routing replay's trainer half and the MoE metrics of an RL step.

The generator records each MoE layer's experts for every token it feeds to the model
(`generator/routes.py`); `routes_batch` lays them out beside the training batch's tokens as
batch["routes"] [B, T-1, MoE layers, top_k] (input position j of row b; -1 where none was
recorded), so that mini-batch and micro-batch splits, padding trims and packing carry them like
every other per-token field. With `[moe] routing_replay = "rollout"` the logprob and update
passes route by them (`data.forward.forward_logprobs(replay_routes=True)`).

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

from titanrl.data.forward import routes_in_rows
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
        L, E = len(self.routers), self.num_experts
        self.loads_LE = torch.zeros(L, E, dtype=torch.float64)
        self.sums = torch.zeros(5, dtype=torch.float64)  # decisions, disagreements, entropy, aux loss, forwards

    @torch.no_grad()
    def observe(self, model: Transformer, batch: TensorDict, packing: str = "off") -> None:
        """After a forward of `model` over `batch`, padded or packed as `forward_logprobs` ran it
        with this `packing`."""
        if not self.routers or "routes" not in batch.keys():
            return
        gen_NLK = routes_in_rows(batch["routes"], layout_of(batch, packing))
        valid_N = (gen_NLK >= 0).all(-1).all(-1)
        trainer_NLK = model.moe_routes().transpose(0, 1)[valid_N]
        gen_NLK = gen_NLK.to(trainer_NLK.device)[valid_N]
        differ_NL = (trainer_NLK.sort(-1).values != gen_NLK.sort(-1).values).any(-1)
        probs_LNE = torch.stack([self._probs[i][valid_N].double() for i in range(len(self.routers))])
        entropy = -(probs_LNE * probs_LNE.clamp_min(1e-30).log()).sum()
        for layer in range(len(self.routers)):
            self.loads_LE[layer] += torch.bincount(trainer_NLK[:, layer].flatten(), minlength=self.num_experts).cpu()
        aux = model.moe_aux_loss().item()
        self.sums += torch.tensor([differ_NL.numel(), differ_NL.sum().item(), entropy.item(), aux, 1.0])

    def metrics(self, dp_group: dist.ProcessGroup | None) -> dict[str, float]:
        """The step's metrics, summed over data-parallel ranks (collective), then reset."""
        if not self.routers:
            return {}
        flat = torch.cat([self.sums, self.loads_LE.flatten()])
        if dp_group is not None:
            dist.all_reduce(flat, group=dp_group)
        decisions, disagree, entropy, aux, forwards = flat[:5].tolist()
        loads_LE = flat[5:].view_as(self.loads_LE)
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
