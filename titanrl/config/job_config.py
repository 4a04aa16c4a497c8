"""The job configuration: one dataclass per TOML section, a docstring under every field.

Precedence is CLI > TOML > the defaults written in the sections. Loading and validation live in
`titanrl/config/manager.py`; a check on one field lives in its section's `validate()`, a check
across sections in `JobConfig.validate()`, and a check that depends on the algorithm in the
algorithm's own `validate()` (`titanrl/algorithms/`), so a reader finds each rule beside what it
concerns.
"""

import dataclasses
from dataclasses import dataclass, field

from titanrl.config.agent import Agent
from titanrl.config.algorithm import Algorithm, Critic, Distillation
from titanrl.config.data import Data
from titanrl.config.evaluation import EvalSuite, validate_suites
from titanrl.config.fault_tolerance import FaultTolerance
from titanrl.config.generation import Generator, Rollout
from titanrl.config.model import LoRA, Model, MoE
from titanrl.config.offline import DPO, SFTWarmup
from titanrl.config.parallelism import Parallelism
from titanrl.config.preflight import Preflight
from titanrl.config.rewards_envs import Env, Reward
from titanrl.config.run import Checkpoint, Job, Metrics, Profiling
from titanrl.config.training import ActivationCheckpoint, Compile, Float8, LRScheduler, Optimizer, Training

MULTI_TURN_TASKS = ("calculator", "python", "guess_number")


@dataclass
class JobConfig:
    """All sections of a titanrl job. Field names here are the TOML section names."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    parallelism: Parallelism = field(default_factory=Parallelism)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    generator: Generator = field(default_factory=Generator)
    algorithm: Algorithm = field(default_factory=Algorithm)
    rollout: Rollout = field(default_factory=Rollout)
    reward: Reward = field(default_factory=Reward)
    data: Data = field(default_factory=Data)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    critic: Critic = field(default_factory=Critic)
    env: Env = field(default_factory=Env)
    agent: Agent = field(default_factory=Agent)
    sft_warmup: SFTWarmup = field(default_factory=SFTWarmup)
    dpo: DPO = field(default_factory=DPO)
    lora: LoRA = field(default_factory=LoRA)
    float8: Float8 = field(default_factory=Float8)
    distillation: Distillation = field(default_factory=Distillation)
    moe: MoE = field(default_factory=MoE)
    preflight: Preflight = field(default_factory=Preflight)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    eval: list[EvalSuite] = field(default_factory=list)
    """The `[[eval]]` suites (an array of tables, not a section): `titanrl/config/evaluation.py`."""

    def validate(self) -> None:
        """Run every section's own checks, then the ones that span sections."""
        for section_field in section_fields():
            section = getattr(self, section_field.name)
            if hasattr(section, "validate"):
                section.validate()
        validate_suites(self.eval)
        if self.eval and self.job.recipe != "rl":
            raise ValueError(
                f"[[eval]] suites sample the policy with the RL recipe's generator; job.recipe is "
                f"'{self.job.recipe}': remove the [[eval]] tables or set job.recipe = 'rl'"
            )
        if self.data.task in MULTI_TURN_TASKS and not self.env.name:
            raise ValueError(f"[data] task '{self.data.task}' is multi-turn: set env.name = '{self.data.task}'")
        if self.agent.function and (self.env.name or self.job.recipe != "rl"):
            raise ValueError(
                "[agent] function plays the episodes of the RL recipe: unset env.name and set job.recipe = 'rl'"
            )
        if self.env.name and self.reward.function:
            raise ValueError("[reward] function is not used with an [env]: the environment's steps give the rewards")
        if self.lora.enable:
            self._validate_lora()
        if self.generator.batch_invariant and (
            self.float8.enable or (self.lora.enable and self.lora.generator == "merged")
        ):
            raise ValueError(
                "[generator] batch_invariant needs the generator to run the trainer's own ops: set "
                "lora.generator = 'runtime' (merged weights are another sum) and float8.enable = false"
            )
        if self.distillation.teacher_hf_checkpoint and self.job.recipe != "rl":
            raise ValueError(
                f"[distillation] teaches the RL recipe's samples; job.recipe is '{self.job.recipe}': "
                "unset distillation.teacher_hf_checkpoint or set job.recipe = 'rl'"
            )
        if self.generator.quantize != "none" and self.parallelism.tp > 1:
            raise ValueError(
                "[generator] quantize cannot shard quantised weights over tp ranks yet: set "
                "generator.quantize = 'none' or parallelism.tp = 1"
            )
        if self.rollout.dynamic_sampling and self.algorithm.group_size < 2:
            raise ValueError(
                "[rollout] dynamic_sampling needs algorithm.group_size >= 2 (it drops groups of equal rewards)"
            )
        if self.rollout.partial:
            self._validate_partial_rollouts()
        if self.rollout.mode in ("one_step", "async"):
            self._validate_one_step()
        if self.fault_tolerance.enable and (self.rollout.mode != "colocated" or self.job.recipe != "rl"):
            raise ValueError(
                "[fault_tolerance] replica groups are colocated RL jobs: set rollout.mode = 'colocated' and "
                "job.recipe = 'rl', or fault_tolerance.enable = false"
            )
        if self.model.max_seq_len and 0 < self.training.micro_batch_tokens < self.model.max_seq_len:
            raise ValueError(
                f"[training] micro_batch_tokens ({self.training.micro_batch_tokens}) is below one sequence "
                f"of model.max_seq_len ({self.model.max_seq_len}); raise it or set 0"
            )

    def _validate_lora(self) -> None:
        if self.job.recipe == "reward_model":
            raise ValueError(
                "[lora] a reward model's new score head must train, and LoRA freezes everything but "
                "the adapters: train the reward model with lora.enable = false"
            )
        if self.float8.enable:
            raise ValueError(
                "[lora] and [float8] cannot be combined yet (adapters go on plain linear layers); turn one off"
            )
        if self.lora.dropout > 0 and self.job.recipe == "rl":
            raise ValueError(
                "[lora] dropout makes the trained policy's logprobs differ from the sampler's and from "
                "its own old logprobs (importance ratios != 1 on-policy): set lora.dropout = 0 for RL"
            )

    def _validate_partial_rollouts(self) -> None:
        if self.algorithm.off_policy_correction == "none":
            raise ValueError(
                "[rollout] partial = true continues samples under newer weights: set algorithm.off_policy_correction "
                "= 'tis' (or 'mis') so that tokens sampled by older weights are importance-weighted"
            )
        if self.env.name or self.agent.function:
            raise ValueError("[rollout] partial = true does not support multi-turn environments ([env] name, [agent])")
        if self.rollout.dynamic_sampling:
            raise ValueError("[rollout] partial = true and rollout.dynamic_sampling cannot be combined")

    def _validate_one_step(self) -> None:
        """Disaggregated rollout ranks (mode 'one_step' or 'async'): what they support."""
        mode = self.rollout.mode
        if mode == "one_step" and self.rollout.staleness and self.algorithm.off_policy_correction == "none":
            raise ValueError(
                "[rollout] mode = 'one_step' trains on samples of the previous weights: set "
                "algorithm.off_policy_correction = 'tis' (or 'mis'), or rollout.staleness = 0"
            )
        if mode == "async" and self.rollout.max_staleness and self.algorithm.off_policy_correction == "none":
            raise ValueError(
                "[rollout] mode = 'async' trains on tokens of older weights: set algorithm.off_policy_correction "
                "= 'tis' (or 'mis'), or rollout.max_staleness = 0"
            )
        unsupported = {
            "env.name": self.env.name,
            "agent.function": self.agent.function,
            "rollout.dynamic_sampling": self.rollout.dynamic_sampling,
            "reward.model_path": self.reward.model_path,
            "parallelism.tp > 1": self.parallelism.tp > 1 and mode == "one_step",
            "job.recipe != 'rl'": self.job.recipe != "rl",
            "lora.enable": self.lora.enable,
            "generator.quantize": self.generator.quantize != "none",
        }
        for name, used in unsupported.items():
            if used:
                raise ValueError(f"[rollout] mode = '{mode}' does not support {name} yet; use mode = 'colocated'")


SUITES = "eval"
"""The JobConfig field holding the `[[eval]]` suites, a list: every other field is a section."""


def section_fields() -> list[dataclasses.Field]:
    """The fields of `JobConfig` that are sections (`[name]` tables of key = value)."""
    return [f for f in dataclasses.fields(JobConfig) if f.name != SUITES]
