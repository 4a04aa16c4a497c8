"""Step statistics: one dataclass of float sums (and a few maxima) per recipe, reduced over
data-parallel ranks in one collective.

    @dataclass
    class MyStats(StepStats):
        tokens: float = 0.0                 # a sum over ranks
        ratio_max: float = maximum(0.0)     # a max over ranks

Adding a metric is one field; `reduced` sends every field in a single all-gather.

Inside an update loop, statistics stay on the device: `add_on_device` / `max_on_device` take
0-d tensors and keep float64 sums (maxima) there, so no micro-batch waits for the device;
`flush` (which `reduced` calls) copies them to the host in one `.tolist()` and adds them to
their fields. The float64 additions are those of python floats in the same order, so the
values are bit-identical to adding each `.item()`.
"""

import dataclasses
import math
from typing import TypeVar

import torch
import torch.distributed as dist

S = TypeVar("S", bound="StepStats")


def maximum(default: float = float("-inf")) -> float:
    """A field reduced by max over ranks, starting at `default`."""
    return dataclasses.field(default=default, metadata={"reduce": "max"})


@dataclasses.dataclass
class StepStats:
    def add_on_device(self, **values: torch.Tensor) -> None:
        """Add 0-d tensors to device sums of these fields (which must be 0 until `flush`)."""
        sums = self.__dict__.setdefault("_device_sums", {})
        for name, value in values.items():
            if name not in sums:
                sums[name] = torch.zeros((), dtype=torch.float64, device=value.device)
            sums[name] += value.detach().double()

    def max_on_device(self, **values: torch.Tensor) -> None:
        """Keep the device maxima of 0-d tensors for these `maximum()` fields; NaNs are ignored,
        as python's max(field, nan) ignores them."""
        maxima = self.__dict__.setdefault("_device_maxima", {})
        for name, value in values.items():
            value = value.detach().double()
            maxima[name] = torch.fmax(maxima[name], value) if name in maxima else value

    def flush(self) -> None:
        """Copy the device sums and maxima to their fields: one host copy for all of them."""
        sums, maxima = self.__dict__.pop("_device_sums", {}), self.__dict__.pop("_device_maxima", {})
        if not sums and not maxima:
            return
        values = torch.stack([*sums.values(), *maxima.values()]).tolist()
        for name, value in zip(sums, values):
            setattr(self, name, getattr(self, name) + value)
        for name, value in zip(maxima, values[len(sums) :]):
            setattr(self, name, max(getattr(self, name), value))

    def reduced(self: S, group: dist.ProcessGroup | None) -> S:
        """Every field summed (or, for `maximum()` fields, maxed) over the ranks of `group`
        (after `flush`)."""
        self.flush()
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
