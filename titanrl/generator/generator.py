"""The in-process generator: the trainer's model code over a paged KV cache.

`generate` runs continuous batching (`scheduler.py`): groups of `n` samples are admitted while
KV blocks are free, their prompt is prefilled once and its blocks are shared by the samples
(copy-on-write for the partly filled last block), all running samples decode together, finished
ones leave and waiting ones join, and when blocks run out the youngest sample is preempted and
later recomputed. Every rank of a TP group runs the same schedule on its shard of heads.
The policy copy and its forwards are `model_runner.py`'s; a call's passes, `step_loop.py`'s.
"""

import math
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanrl.components.compile_cache import compile_seconds
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.config.model import LoRA as LoRAConfig
from titanrl.distributed.utils import return_freed_host_memory
from titanrl.generator.decode import static_kv_for_cuda_graphs
from titanrl.generator.kv_cache import BlockAllocator, KVCachePool, blocks_from_memory
from titanrl.generator.model_runner import ModelRunner
from titanrl.generator.sampling import SamplingParams, validate_prompts
from titanrl.generator.scheduler import Scheduler
from titanrl.generator.sequence import (
    Completion,
    GenerationStats,
    PauseWhen,
    ResumedSample,
    TurnHandler,
)
from titanrl.generator.state_slots import StateSlots
from titanrl.generator.step_loop import StepLoop
from titanrl.generator.weight_sync import (
    can_sync_trainable_only,
    copy_expert_bias,
    copy_trainer_weights,
    share_trainer_weights,
    weight_storage,
)
from titanrl.generator.window_pages import WindowPages, build_window_pages, kv_layers, window_pool_blocks
from titanrl.models.args import TransformerModelArgs
from titanrl.models.hf import load_hf_weights
from titanrl.models.mla import latent_cache_dims
from titanrl.models.model import Transformer
from titanrl.models.tokenizer import Tokenizer

__all__ = ["Completion", "GenerationStats", "Generator", "PauseWhen", "ResumedSample", "TurnHandler"]


def kv_cache_dims(args: TransformerModelArgs, tp: int) -> tuple[int, int, bool]:
    """(KV heads per rank, head dim, latent) of a token's cache entry: MLA caches one latent a
    token (`models/mla.py`)."""
    if args.kv_lora_rank:
        return (*latent_cache_dims(args), True)
    return args.n_kv_heads // tp, args.head_dim, False


class Generator:
    """Generates with its own copy of the policy (TP-sharded like the trainer's, synced in place
    by `load_weights`) over a KV pool that `sleep` frees for training and `wake` brings back.

    `config` is the job's `[generator]` section; its sampling fields (temperature, ...) are the
    caller's business: `generate` takes `SamplingParams`. `eos_id` defaults to the tokenizer's;
    `extra_eos_ids` also stop a sample (chat models list several, e.g. Qwen's <|im_end|> and
    <|endoftext|> in generation_config.json).
    """

    def __init__(
        self,
        model_args: TransformerModelArgs,
        config: GeneratorConfig,
        device: torch.device,
        *,
        eos_id: int | None = None,
        extra_eos_ids: tuple[int, ...] = (),
        tp_mesh: DeviceMesh | None = None,
        tokenizer: Tokenizer | None = None,
        dtype: torch.dtype = torch.float32,
        lora: LoRAConfig | None = None,
        ep_mesh: DeviceMesh | None = None,
    ) -> None:
        config.validate()
        self.args = model_args
        self.config = config
        self.lora = lora
        self.device = device
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.eos_id = eos_id if eos_id is not None else getattr(tokenizer, "eos_id", None)
        self.eos_ids = frozenset(extra_eos_ids) | ({self.eos_id} if self.eos_id is not None else set())
        self.runner = ModelRunner(model_args, config, device, dtype, lora=lora, tp_mesh=tp_mesh, ep_mesh=ep_mesh)
        self.tp = self.runner.tp
        # The runner's, read here and by callers: the same objects for the generator's lifetime
        # (`model` is a property: a model put in its place, e.g. a test's scripted one, is the runner's).
        self.quantizer = self.runner.quantizer
        self.lockstep = self.runner.lockstep
        self.compile = self.runner.compile
        self.attention = self.runner.attention
        self.shares_weights = False
        # gpt-oss: sliding-window layers keep their pages in a smaller pool (`window_pages.py`).
        window_cap = window_pool_blocks(model_args, config, num_blocks=2**62)
        self.num_blocks = config.num_blocks or blocks_from_memory(
            self.device,
            config.kv_cache_memory_fraction,
            self._bytes_per_block(),
            self._state_slot_bytes() + window_cap * self._bytes_per_block(sliding=True),
        )
        self.window_blocks = window_pool_blocks(model_args, config, self.num_blocks)
        """Pages of the sliding-window layers' pool; 0: no such layers, every layer in `pool`."""
        self.pool: KVCachePool | None = None
        self.allocator: BlockAllocator | None = None
        self.window_pages: WindowPages | None = None
        self._offloaded: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._base_loaded = False  # the frozen parameters hold the trainer's values (`load_weights`)
        self.wake()

    # ---- memory: time-slicing with the trainer ----

    def _bytes_per_block(self, sliding: bool = False) -> int:
        heads, head_dim, latent = kv_cache_dims(self.args, self.tp)
        n_kv_layers = sum(kv_layers(self.args, in_window_pool=sliding))
        return max(
            1,
            KVCachePool.bytes_per_block(
                n_kv_layers, self.config.block_size, heads, head_dim, self.dtype, latent=latent
            ),
        )

    def _state_slot_bytes(self) -> int:
        """A hybrid model's state slots (`StateSlots`), taken from the KV pool's memory budget."""
        if not self.args.has_linear_layers:
            return 0
        return StateSlots.bytes_for(self.args, self.config.max_num_seqs, self.dtype, self.tp)

    def wake(self) -> None:
        """Allocate the KV pool (empty: prefix cache entries do not survive a sleep) and bring
        offloaded weights back."""
        for local, host in self._offloaded:
            local.data = host.to(self.device)
        self._offloaded = []
        if self.pool is None:
            return_freed_host_memory()  # what training freed, before the pool takes its place
            kv_heads, head_dim, latent = kv_cache_dims(self.args, self.tp)
            # One extra block, never handed out, takes the K/V writes of padding rows.
            self.pool = KVCachePool(
                self.args.n_layers,
                self.num_blocks + 1,
                self.config.block_size,
                kv_heads,
                head_dim,
                self.dtype,
                self.device,
                kv_layers=kv_layers(self.args, in_window_pool=False),
                latent=latent,
            )
            self.window_pages = None
            if self.window_blocks:  # gpt-oss: the sliding-window layers' pages (`window_pages.py`)
                dims = (kv_heads, head_dim, latent)
                args = self.args
                self.window_pages = build_window_pages(
                    args, self.config, self.window_blocks, self.pool, dims, self.dtype, self.device
                )
            # Hybrid models: recurrent-state slots beside the pool; no prefix caching (`state_slots.py`).
            hybrid = self.args.has_linear_layers
            self.runner.state_slots = (
                StateSlots(self.args, self.config.max_num_seqs, self.dtype, self.device, self.tp) if hybrid else None
            )
            self.allocator = BlockAllocator(self.num_blocks, self.config.enable_prefix_caching and not hybrid)
            self.block_routes: dict[int, torch.Tensor] = {}  # `routes.record_prefill_routes`
            if self.runner.cuda_graphs:
                static_kv_for_cuda_graphs(self.pool.k, self.pool.v)
                if self.window_pages is not None:
                    static_kv_for_cuda_graphs(self.window_pages.pool.k, self.window_pages.pool.v)

    def sleep(self, offload_weights: bool = False) -> None:
        """Free the KV pool so training can use the memory; optionally move the weights to host
        memory too (on a CPU device they already are, and stay put)."""
        self.pool = None
        self.allocator = None
        self.window_pages = None
        self.runner.state_slots = None
        if offload_weights and self.device.type != "cpu" and not self.shares_weights:
            for local in weight_storage(self.model):
                self._offloaded.append((local, local.data.to("cpu", non_blocking=True)))
                local.data = torch.empty(0, dtype=local.dtype, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return_freed_host_memory()

    @property
    def model(self) -> Transformer:
        """The generator's model (the runner's)."""
        return self.runner.model

    @model.setter
    def model(self, model: Transformer) -> None:
        self.runner.model = model

    @property
    def state_slots(self) -> StateSlots | None:
        """A hybrid model's recurrent-state slots (the runner's; None asleep or for a transformer)."""
        return self.runner.state_slots

    @property
    def kv_cache_bytes(self) -> int:
        window = self.window_pages.pool.nbytes if self.window_pages is not None else 0
        return (self.pool.nbytes if self.pool is not None else 0) + window

    # ---- weights ----

    def load_weights(self, trainer_model: nn.Module) -> None:
        """Copy the trainer's weights into this generator's, in place (`weight_sync`): quantised ones
        are re-quantised; with runtime LoRA, loads after the first copy only the adapters."""
        copy_trainer_weights(self.model, trainer_model, self.quantizer, trainable_only=self._base_loaded)
        copy_expert_bias(self.model, trainer_model)
        self._base_loaded = can_sync_trainable_only(self.model)
        # Cached prefix blocks hold K/V computed with the old weights.
        if self.allocator is not None:
            self.allocator.reset_prefix_cache()
        if self.window_pages is not None:
            self.window_pages.allocator.reset_prefix_cache()

    def share_weights(self, trainer_model: nn.Module) -> bool:
        """Use the trainer's parameter storage as this generator's weights when their layouts
        match (one rank, no FSDP / TP, same dtype): no second copy, and `load_weights` has
        nothing to copy. Returns whether they are shared (see `weight_sync.share_trainer_weights`);
        never with `quantize`: the generator holds its own quantised weights."""
        self.shares_weights = self.quantizer is None and share_trainer_weights(self.model, trainer_model)
        return self.shares_weights

    def load_hf(self, folder: str) -> None:
        """Load weights from an HF safetensors folder (standalone use, without a trainer)."""
        load_hf_weights(self.model, folder)
        self._base_loaded = False
        if self.allocator is not None:
            self.allocator.reset_prefix_cache()
        if self.window_pages is not None:
            self.window_pages.allocator.reset_prefix_cache()

    # ---- generation ----

    def _validate(
        self, prompts: list[list[int]], params: SamplingParams, resume: Sequence[ResumedSample], partial_turns: bool
    ) -> None:
        """`partial_turns`: pause / resume or on_finish asked for multi-turn episodes."""
        params.validate()
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer= to the Generator")
        validate_prompts(prompts, self.args.max_seq_len, self.args.vocab_size)
        for i, prompt in enumerate(prompts):
            self._check_pool_fits(i, len(prompt), params.max_new_tokens)
        if partial_turns:
            raise ValueError("pause / resume and on_finish do not support multi-turn environments")
        for r in resume:
            r.validate(len(prompts[r.prompt_index]), self.args.max_seq_len)

    def _check_pool_fits(self, i: int, prompt_len: int, max_new_tokens: int) -> None:
        """A lone sequence must fit in the pool: preemption cannot make room for it."""
        total = min(prompt_len + max_new_tokens, self.args.max_seq_len)
        needed = math.ceil(total / self.config.block_size)
        if needed > self.num_blocks:
            raise ValueError(
                f"the KV pool has {self.num_blocks} blocks of {self.config.block_size} tokens, but prompt {i} "
                f"with max_new_tokens={max_new_tokens} needs {needed} blocks "
                f"({needed * self._bytes_per_block()} bytes); raise generator.num_blocks or the memory fraction"
            )

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_ids: list[int] | None = None,
        turns: TurnHandler | None = None,
        *,
        resume: Sequence[ResumedSample] = (),
        pause_when: PauseWhen | None = None,
        on_finish: Callable[[list[Completion]], None] | None = None,
    ) -> tuple[list[Completion], GenerationStats]:
        """Generate `params.n` samples per prompt. Results are ordered by (prompt, sample).

        Sample j of prompt i draws from a random stream seeded by (params.seed, prompt_ids[i], j);
        passing global prompt ids makes samples independent of how prompts are split over ranks.
        With `turns`, samples are multi-turn episodes (`TurnHandler`); max_new_tokens is per turn.
        Partial rollouts: `pause_when` (asked after every scheduler pass) pauses the unfinished
        samples, which come back with finish_reason 'paused'; `resume` continues paused samples
        of `prompts` (those prompts are not forked into new groups; only the resumed samples of
        them are returned).
        """
        partial = bool(resume) or pause_when is not None or on_finish is not None
        try:
            self._validate(prompts, params, resume, partial_turns=partial and turns is not None)
        except ValueError:
            if self.lockstep is not None:  # the peers must not wait for this rank's forwards
                self.lockstep.agree(ok=False)
            raise
        if self.lockstep is not None:
            self.lockstep.agree(ok=True)
        if self.pool is None or self.allocator is None:
            raise RuntimeError("generate() on a sleeping generator: call wake() first")
        start, compile_start = time.perf_counter(), compile_seconds()
        sched = Scheduler(
            self.pool,
            self.allocator,
            self.config,
            prompts,
            list(range(len(prompts))) if prompt_ids is None else prompt_ids,
            params,
            max_seq_len=self.args.max_seq_len,
            vocab_size=self.args.vocab_size,
            turns=turns,
            resume=resume,
            window=self.window_pages,
        )
        StepLoop.of(self, sched).run(turns, pause_when, on_finish)
        results = sched.results()
        sched.stats.seconds = time.perf_counter() - start
        sched.stats.compile_seconds = compile_seconds() - compile_start
        return [seq.to_completion(self.tokenizer) for seq in results], sched.stats
