"""Step statistics: one dataclass of float sums (and a few maxima) per recipe, reduced over
data-parallel ranks in one collective.

    @dataclass
    class MyStats(StepStats):
        tokens: float = 0.0                 # a sum over ranks
        ratio_max: float = maximum(0.0)     # a max over ranks

Adding a metric is one field; `reduced` sends every field in a single all-gather.
"""

import dataclasses
import math

import torch
import torch.distributed as dist


def maximum(default: float = float("-inf")) -> float:
    """A field reduced by max over ranks, starting at `default`."""
    return dataclasses.field(default=default, metadata={"reduce": "max"})


@dataclasses.dataclass
class StepStats:
    def reduced(self, group: dist.ProcessGroup | None) -> "StepStats":
        """Every field summed (or, for `maximum()` fields, maxed) over the ranks of `group`."""
        fields = dataclasses.fields(self)
        local = torch.tensor([float(getattr(self, f.name)) for f in fields], dtype=torch.float64)
        if group is None or dist.get_world_size(group) == 1:
            return dataclasses.replace(self)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        by_rank = torch.stack(gathered)
        values = {
            f.name: (by_rank[:, i].max() if f.metadata.get("reduce") == "max" else by_rank[:, i].sum()).item()
            for i, f in enumerate(fields)
        }
        return type(self)(**values)


def finite_max(values: list[float]) -> float:
    """The largest finite value; nan when there is none (e.g. every update was skipped)."""
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else float("nan")
