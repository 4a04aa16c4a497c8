"""`titanrl plan`: a job's memory per rank on N devices, planned in one CPU process from the
real mesh and parallelised models built on the meta device under a fake process group."""

from titanrl.plan.memory import GPUS, JobPlan, RankPlan, device_bytes, plan_job, plan_rank

__all__ = ["GPUS", "JobPlan", "RankPlan", "device_bytes", "plan_job", "plan_rank"]
