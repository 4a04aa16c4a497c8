"""The Trainer: builds everything a job needs from its `JobConfig`, then runs the loop.

    trainer = Trainer(config, recipe_cls)   # mesh, tokenizer, model, optimizer, lr schedule, checkpointer,
                                # metrics, watchdog, then the recipe's own parts (data, generator,
                                # rewards, reference, critic ...): complete when it returns
    trainer.train()             # resume or prepare; for each step: recipe.step(...), eval, log,
                                # checkpoint; export

What a job trains is its recipe (`titanrl/recipes/`, chosen by `job.recipe`). The Trainer owns
what every recipe shares, once: checkpoint save and resume, the non-finite-update policy, the
watchdog, evaluation and logging.
"""

import os
import random
import re
import signal
import time
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from titanrl.components import launch
from titanrl.components.checkpoint import CheckpointManager
from titanrl.components.console import get_logger
from titanrl.components.fault_tolerance import FaultTolerance, load_local_state, local_state
from titanrl.components.faults import fault_active, fault_point
from titanrl.components.float8 import precompute_float8_scales
from titanrl.components.loss import global_token_count
from titanrl.components.metrics import MetricsLogger
from titanrl.components.optimizer import build_lr_scheduler, build_optimizer
from titanrl.components.profiling import MemorySnapshot, maybe_enable_memory_snapshot, maybe_enable_profiling
from titanrl.components.timer import phase, straggler_metrics
from titanrl.components.watchdog import Watchdog
from titanrl.config import JobConfig
from titanrl.data.batch import plan_micro_batches
from titanrl.data.encode import PromptEncoder
from titanrl.distributed import clip_grad_norm_, dp_sum
from titanrl.models.hf import export_hf, export_lora
from titanrl.models.moe import MoE
from titanrl.models.tokenizer import build_tokenizer

log = get_logger(__name__)


class RecipeClass(Protocol):
    """What the Trainer needs of a recipe class (`titanrl.recipes.base.Recipe`, which sits above
    the Trainer in the layers): its data, its model, and an instance built on the Trainer."""

    def load_data(self, config: JobConfig) -> Any: ...

    def build_model(self, trainer: "Trainer") -> Any: ...

    def __call__(self, trainer: "Trainer", data: Any) -> Any: ...


class Trainer:
    def __init__(self, config: JobConfig, recipe_cls: RecipeClass) -> None:
        """`recipe_cls`: what the job trains, a `titanrl.recipes.base.Recipe` subclass
        (`titanrl.recipes.get_recipe(config.job.recipe)`). Recipes build on the Trainer, which
        sits below them in the layers, so the class is handed in rather than looked up here."""
        data = recipe_cls.load_data(config)  # bad data fails before anything is built
        self.config = config
        self.rank, self.dims, self.device = launch.start(config)
        # [fault_tolerance]: heartbeating to the lighthouse from start-up, so that the first
        # step's quorum waits for every replica group that is starting; used from step 1 on.
        self.ft_step, self.ft_active = 0, False
        self.evals: tuple[dict[str, float], dict[str, float]] = ({}, {})
        self.ft = start_fault_tolerance(self)
        # Rank 0 owns the dump folder before anything is written there (metrics, checkpoints).
        self.folder_lock = launch.lock_dump_folder(config.job.dump_folder) if self.rank == 0 else None
        self.stop_signals = launch.StopSignals()
        self.dp_group = self.dims.dp_mesh.get_group() if self.dims.dp_size > 1 else None
        self.tokenizer = build_tokenizer(config.model.tokenizer)
        self.model_args = launch.model_args(config, self.tokenizer.vocab_size)
        self.encode_prompt = PromptEncoder.from_config(config.data, config.model.tokenizer, self.tokenizer)
        self.watchdog = Watchdog(config.job.phase_timeout_s, self.rank)
        ckpt = config.checkpoint
        self.checkpointer = CheckpointManager(
            os.path.join(config.job.dump_folder, ckpt.folder),
            ckpt.keep_latest_k,
            ckpt.async_mode,
            error_log=os.path.join(config.job.dump_folder, "checkpoint_errors.log"),
        )
        self.resuming = ckpt.enable and (bool(ckpt.load_path) or bool(self.checkpointer.complete_steps()))
        # A replica group started again ([fault_tolerance]) logs on after its earlier rows.
        self.metrics = MetricsLogger(config, self.rank, append=self.resuming or config.fault_tolerance.enable)
        self.model = recipe_cls.build_model(self)
        self.configure_moe(self.model)
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.training.steps, config.lr_scheduler)
        self.recipe = recipe_cls(self, data)
        self.checkpoint = RunCheckpoint(self)
        if self.ft is not None and (getattr(self.recipe, "critic", None) is not None):
            raise ValueError("[fault_tolerance] does not support a critic (PPO) yet: use a critic-free algorithm")

    # ---- the loop ----

    def train(self) -> dict[str, float]:
        """Run the job to `training.steps`; returns the first and last evaluation."""
        cfg = self.config
        self._banner()
        restored = self.checkpoint.load()
        if restored is None:
            start, (first_eval, last_eval) = 1, self.begin()
        else:
            start, first_eval, last_eval = restored["step"] + 1, restored["first_eval"], restored["last_eval"]
        self.metrics.keep_through(start - 1)  # a resumed run redoes the steps after its checkpoint
        dump = cfg.job.dump_folder
        with (
            maybe_enable_profiling(cfg.profiling, dump, start - 1) as profiler,
            maybe_enable_memory_snapshot(cfg.profiling, dump, start - 1, self.device) as memory,
        ):
            stopped, last_eval = self.run_steps(start, first_eval, last_eval, profiler, memory)
        if not stopped:
            self.checkpoint.wait()
            self._finish(first_eval, last_eval)
        return {**{f"first_{k}": v for k, v in first_eval.items()}, **last_eval}

    def run_steps(
        self,
        start: int,
        first_eval: dict[str, float],
        last_eval: dict[str, float],
        profiler: torch.profiler.profile | None,
        memory: MemorySnapshot | None,
    ) -> tuple[bool, dict[str, float]]:
        """Steps `start` .. training.steps, each evaluated, logged and checkpointed as configured;
        returns (stopped early by a signal, the last evaluation)."""
        cfg = self.config
        batches = iter(self.recipe.loader)
        step_times: list[float] = []
        step = start
        self.evals = (first_eval, last_eval)
        while step <= cfg.training.steps:
            began = time.perf_counter()
            if self.ft is not None:
                self.ft_step, self.ft_active = step - 1, True
                self.ft.start_step(fresh=step == 1)  # a restarted group heals here: it goes on at its peers' step
                if self.ft.healed:
                    step, batches = self.ft_step + 1, iter(self.recipe.loader)
            metrics = self.recipe.step(batches, step)
            if self.ft is not None:
                metrics.update(self.ft.metrics())
            fault_point("step", step)
            metrics.update(straggler_metrics({k[5:]: v for k, v in metrics.items() if k.startswith("time_")}))
            evaluated = bool(cfg.metrics.eval_freq) and step % cfg.metrics.eval_freq == 0 or step == cfg.training.steps
            if evaluated:
                last_eval = self.evaluate()
                metrics.update(last_eval)
                self.evals = (first_eval, last_eval)
            step_times.append(time.perf_counter() - began)
            if step % cfg.metrics.log_freq == 0 or evaluated:
                metrics["eta_s"] = sum(step_times) / len(step_times) * (cfg.training.steps - step)
                self.metrics.log(step, {"phase": self.recipe.name, **metrics}, self.recipe.console)
            saved = cfg.checkpoint.enable and (step % cfg.checkpoint.interval == 0 or step == cfg.training.steps)
            if saved:
                self.checkpoint.save(step, first_eval, last_eval)
            if profiler is not None:
                profiler.step()
            if memory is not None:
                memory.step()
            signum = self.stop_signals.agreed()
            if signum and step < cfg.training.steps:
                self._stop(signum, step, saved, first_eval, last_eval)
                return True, last_eval
            step += 1
        return False, last_eval

    def begin(self) -> tuple[dict[str, float], dict[str, float]]:
        """A fresh run: the recipe's preparation (e.g. RL's SFT warm-up), then the step-0 eval."""
        self.recipe.prepare()
        first_eval = self.evaluate()
        self.metrics.log(0, {"phase": self.recipe.name, **first_eval}, self.recipe.console)
        return first_eval, first_eval

    def evaluate(self, **options) -> dict[str, float]:
        """The recipe's evaluation under the watchdog's 'eval' phase; `options` go to the recipe."""
        with phase(self.watchdog, "eval"):
            return self.recipe.evaluate(**options)

    def close(self) -> None:
        self.recipe.close()
        self.metrics.close()
        self.checkpointer.close()
        self.stop_signals.restore()
        launch.shutdown()
        if self.folder_lock is not None:
            self.folder_lock.close()

    def _stop(
        self, signum: int, step: int, saved: bool, first_eval: dict[str, float], last_eval: dict[str, float]
    ) -> None:
        """Preempted (SIGTERM / SIGUSR1): checkpoint this step if it was not just saved, then
        return so that the process exits 0 and a requeued job resumes from here."""
        if self.config.checkpoint.enable and not saved:
            self.checkpoint.save(step, first_eval, last_eval)
        self.checkpoint.wait()
        where = self.checkpointer.step_dir(step) if self.config.checkpoint.enable else ""
        if self.rank == 0:
            launch.write_stopped(self.config.job.dump_folder, signum, step, where)
            log.info(
                f"titanrl: stopped by {signal.Signals(signum).name} after step {step}; "
                + (
                    f"checkpoint {where} saved, run the same command again to resume"
                    if where
                    else "checkpoint.enable is off, so this run cannot resume"
                )
            )

    def _banner(self) -> None:
        if self.rank == 0:
            n_params = sum(p.numel() for p in self.model.parameters())  # DTensor numel is global
            model = self.config.model.hf_checkpoint.rstrip("/") or f"flavor {self.config.model.flavor}"
            log.info(
                f"titanrl | {self.config.job.description} | recipe {self.recipe.name} | {self.dims.world_size} "
                f"rank(s) {self.dims} | model {model} ({n_params / 1e6:.1f}M params) | "
                f"data {self.config.data.path or 'task ' + self.config.data.task}"
            )

    def _finish(self, first_eval: dict[str, float], last_eval: dict[str, float]) -> None:
        if self.config.checkpoint.export_hf:
            export_hf(self.model, os.path.join(self.config.job.dump_folder, "hf"))
            if self.config.lora.enable and self.config.lora.export_peft:
                export_lora(self.model, self.config)
        if self.rank == 0:
            # .get: a run resumed from an older checkpoint may not have had every eval metric at step 0
            summary = ", ".join(
                f"{k} {first_eval.get(k, float('nan')):.4f} -> {last_eval[k]:.4f}" for k in sorted(last_eval)
            )
            log.info(f"{self.recipe.name}: {summary}")

    # ---- what recipes share inside a step ----

    def backward(self, loss: torch.Tensor, step: int) -> None:
        # Fault hooks (tests): poison one update, or hang in it, for every recipe alike.
        if fault_active("hang_train", step):
            time.sleep(3600)
        (loss * float("nan") if fault_active("nan_loss", step) else loss).backward()

    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, what: str) -> float:
        """Clip, then step unless the gradient norm is non-finite (skip the update and return
        nan, or stop: training.on_nonfinite)."""
        ft = self.ft if self.ft_active else None  # not in the SFT warm-up: every group does its own
        if ft is not None:  # summed over the replica groups of this step's quorum
            ft.reduce_gradients(model)
        grad_norm = clip_grad_norm_(list(model.parameters()), self.config.training.max_norm)
        if ft is not None and not ft.should_commit():  # a group failed in the step: nobody steps
            optimizer.zero_grad()
            return float("nan")
        # The norm is global (all ranks agree), so every rank takes the same branch.
        if not torch.isfinite(grad_norm):
            if self.config.training.on_nonfinite == "stop":
                raise FloatingPointError(
                    f"non-finite gradient norm in the {what} update (loss or logprobs overflowed); "
                    "lower optimizer.lr, check rewards and data, or set training.on_nonfinite = 'skip'"
                )
            optimizer.zero_grad()
            return float("nan")
        optimizer.step()
        self.update_expert_biases(model)
        # float8 all-gather: one all-reduce for every weight's scale instead of one per weight.
        precompute_float8_scales(model, self.config.float8)
        return grad_norm.item()

    def configure_moe(self, model: nn.Module) -> None:
        """[moe]: each MoE layer's share of the load-balancing loss in backward (the mean over
        layers, summed over dp ranks, so divided by both), and a check that a bias update has
        a bias to move."""
        layers = [m for m in model.modules() if isinstance(m, MoE)]
        for layer in layers:
            layer.aux_loss_coeff = self.config.moe.aux_loss_coeff / (len(layers) * self.dims.dp_size)
        if self.config.moe.bias_update_rate > 0 and not (layers and all(layer.use_expert_bias for layer in layers)):
            raise ValueError(
                f"[moe] bias_update_rate = {self.config.moe.bias_update_rate} needs a mixture-of-experts "
                "model with moe_expert_bias on; this model has "
                + ("no MoE layers" if not layers else "no expert bias")
                + ": set [moe] bias_update_rate = 0 or use such a model"
            )

    @torch.no_grad()
    def update_expert_biases(self, model: nn.Module) -> None:
        """The auxiliary-loss-free bias update after an optimizer step, from the loads summed over
        dp ranks (TP peers count the same tokens and are not summed), equal on every rank."""
        if self.config.moe.bias_update_rate <= 0:
            return
        for layer in model.modules():
            if isinstance(layer, MoE):
                if self.dp_group is not None:
                    dist.all_reduce(layer.tokens_per_expert, group=self.dp_group)
                layer.update_expert_bias(self.config.moe.bias_update_rate)

    def dp_sum(self, values: list[float]) -> list[float]:
        """Host numbers summed over data-parallel ranks (TP peers hold equal copies, not counted)."""
        return dp_sum(values, self.dp_group)

    def plan_micro_batches(self, lengths: list[int], sort_single: bool = False) -> list[torch.Tensor]:
        """This rank's micro-batches of training.micro_batch_tokens (`data.batch.plan_micro_batches`)."""
        return plan_micro_batches(lengths, self.config.training.micro_batch_tokens, self.dp_group, sort_single)


def start_fault_tolerance(trainer: "Trainer") -> FaultTolerance | None:
    """This replica group's TorchFT manager ([fault_tolerance]), heartbeating from start-up
    so that the lighthouse waits for every group at the first step; a peer that heals from
    it gets the state of the step before the one it starts (`trainer.ft_step`)."""
    cfg = trainer.config
    if not cfg.fault_tolerance.enable:
        return None
    if cfg.algorithm.ppo_epochs * cfg.algorithm.num_minibatches > 1:
        raise ValueError(
            "[fault_tolerance] commits one optimizer step per RL step for now: set algorithm.ppo_epochs = 1 "
            "and algorithm.num_minibatches = 1"
        )

    def state() -> dict:  # asked by a peer that heals, while this group waits for the quorum
        run = trainer.checkpoint
        return {**local_state(*run.parts()), "host": run.host_state(trainer.ft_step, *trainer.evals)}

    def load(state: dict) -> None:
        run = trainer.checkpoint
        load_local_state(state, *run.parts())
        run.load_host_state(state["host"])
        trainer.ft_step = state["host"]["step"]

    return FaultTolerance(trainer.config.fault_tolerance, trainer.device, state, load)


def loss_counts(trainer: "Trainer", mask_BT: torch.Tensor, num_seqs: float) -> tuple[float, float]:
    """A mini-batch's loss tokens and sequences summed over every data-parallel rank of the
    step, those of the other replica groups in the quorum included ([fault_tolerance])."""
    tokens = global_token_count(mask_BT, trainer.dp_group).item()
    (seqs,) = trainer.dp_sum([num_seqs])
    if trainer.ft is not None and trainer.ft_active:
        tokens, seqs = trainer.ft.sum(torch.tensor([tokens, seqs], dtype=torch.float64)).tolist()
    return max(tokens, 1.0), seqs


class RunCheckpoint:
    """What a run saves at a step and restores on resume, beside the Trainer's checkpointer: the
    models and optimizers (the Trainer's and the recipe's), the lr schedule, the loader's
    position, the RNGs, the evaluations so far and the recipe's host state."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def parts(self) -> tuple[dict[str, nn.Module], dict[str, torch.optim.Optimizer]]:
        t = self.trainer
        models, optimizers = t.recipe.checkpoint_parts()
        return {"model": t.model, **models}, {"model": t.optimizer, **optimizers}

    def save(self, step: int, first_eval: dict[str, float], last_eval: dict[str, float]) -> None:
        t = self.trainer
        host = self.host_state(step, first_eval, last_eval)
        with phase(t.watchdog, "checkpoint"):
            t.checkpointer.save(step, *self.parts(), host)

    def host_state(self, step: int, first_eval: dict[str, float], last_eval: dict[str, float]) -> dict:
        """What a checkpoint (and a healing replica group) takes beside the models and optimizers."""
        t = self.trainer
        return {
            "step": step,
            "scheduler": t.lr_scheduler.state_dict(),
            "loader": t.recipe.loader.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "py_rng": random.getstate(),
            "first_eval": first_eval,
            "last_eval": last_eval,
            "recipe": t.recipe.state_dict(),
        }

    def load_host_state(self, host: dict) -> None:
        t = self.trainer
        t.lr_scheduler.load_state_dict(host["scheduler"])
        t.recipe.loader.load_state_dict(host["loader"])
        t.recipe.load_state_dict(host.get("recipe", {}))
        torch.set_rng_state(host["torch_rng"])
        random.setstate(host["py_rng"])

    def wait(self) -> None:
        """Wait for the async save in flight, if any, and raise its error (sync saves: no-op)."""
        with phase(self.trainer.watchdog, "checkpoint"):
            self.trainer.checkpointer.wait()

    def load(self) -> dict | None:
        """Restore checkpoint.load_path, else the latest complete checkpoint of this run, if any;
        returns its host state (step, evals) or None for a fresh run."""
        t = self.trainer
        if not t.resuming:
            return None
        notice = log.info if t.rank == 0 else lambda _: None
        path = t.config.checkpoint.load_path.rstrip("/")
        if path:
            match = re.fullmatch(r"step-(\d+)", os.path.basename(path))
            if not match or not os.path.exists(os.path.join(path, ".metadata")):
                raise ValueError(f"checkpoint.load_path '{path}' is not a complete titanrl step-N checkpoint folder")
            # A corrupt or refused load_path raises CheckpointCorrupt, a user error: one line, exit 2.
            host = t.checkpointer.load(path, *self.parts(), log=notice)
        else:
            # Damaged checkpoints are skipped with one line each; none loadable is CheckpointCorrupt.
            restored = t.checkpointer.load_latest(*self.parts(), log=notice)
            if restored is None:
                return None
            host = restored[1]
            path = t.checkpointer.step_dir(restored[0])
        self.load_host_state(host)
        if t.rank == 0:
            log.info(f"resumed from {path} (step {host['step']})")
        return host
