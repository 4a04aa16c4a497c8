"""The in-process generator: the trainer's model code over a paged KV cache.

`generate` runs continuous batching (`scheduler.py`): groups of `n` samples are admitted while
KV blocks are free, their prompt is prefilled once and its blocks are shared by the samples
(copy-on-write for the partly filled last block), all running samples decode together, finished
ones leave and waiting ones join, and when blocks run out the youngest sample is preempted and
later recomputed. Every rank of a TP group runs the same schedule on its shard of heads.
"""

import contextlib
import math
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanrl.components.compile_cache import compile_seconds
from titanrl.config.adapt_sections import LoRA as LoRAConfig
from titanrl.config.rl_sections import Generator as GeneratorConfig
from titanrl.distributed.parallelize import apply_ep, apply_tp
from titanrl.distributed.utils import return_freed_host_memory
from titanrl.generator.decode import (
    DecodeRows,
    batch_bucket,
    compile_decode,
    decode_step,
    run_decode_pass,
    static_kv_for_cuda_graphs,
    uses_cuda_graphs,
)
from titanrl.generator.ep_lockstep import EPLockstep, with_tick
from titanrl.generator.kv_cache import BlockAllocator, KVCachePool, blocks_from_memory
from titanrl.generator.paged_attention import PagedBatch, SeqSlice, attention_kinds, paged_attention
from titanrl.generator.routes import add_route_chunk, has_moe_layers, record_packed_routes, record_prefill_routes
from titanrl.generator.sampling import SamplingParams, sample_tokens, sampled_logprobs, validate_prompts
from titanrl.generator.scheduler import Scheduler
from titanrl.generator.sequence import Completion, GenerationStats, PauseWhen, ResumedSample, Seq, TurnHandler
from titanrl.generator.weight_sync import (
    build_quantizer,
    can_sync_trainable_only,
    copy_expert_bias,
    copy_trainer_weights,
    share_trainer_weights,
    weight_storage,
)
from titanrl.models.args import TransformerModelArgs
from titanrl.models.batch_invariant import batch_invariant_mode
from titanrl.models.hf import load_hf_weights
from titanrl.models.lora import add_lora
from titanrl.models.model import Transformer
from titanrl.models.tokenizer import Tokenizer

__all__ = ["Completion", "GenerationStats", "Generator", "PauseWhen", "ResumedSample", "TurnHandler"]


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
        self.tp = tp_mesh.size() if tp_mesh is not None else 1
        self.record_routes = has_moe_layers(model_args)  # routing replay (`routes.py`)
        if self.record_routes and config.quantize != "none":
            raise ValueError(
                f"[generator] quantize = '{config.quantize}' is not supported for mixture-of-experts models "
                "(routed experts are grouped weights, and a quantised router would pick other experts than "
                "the trainer's): set generator.quantize = 'none'"
            )
        self.quantizer = build_quantizer(config.quantize, device, dtype, self.tp)  # before the model
        ep_mesh = ep_mesh if ep_mesh is not None and ep_mesh.size() > 1 else None
        self.model = self._build_model(tp_mesh, ep_mesh)
        # Experts sharded over ep ranks: every forward in lockstep with the peers (`ep_lockstep.py`).
        self.lockstep = EPLockstep(self.model, ep_mesh, device) if ep_mesh is not None else None
        self.shares_weights = False
        self._decode_model = self.model
        # Unset: compiled on CUDA (never with batch_invariant, whose kernels run eagerly).
        auto_compile = device.type == "cuda" and not config.batch_invariant
        self.compile = config.compile if config.compile is not None else auto_compile
        self.attention, self.eager_attention = attention_kinds(config, device, self.compile)
        if device.type == "cuda" and "flex" in (self.attention, self.eager_attention) and config.block_size % 16:
            raise ValueError(
                f"[generator] block_size must be a multiple of 16 on CUDA (FlexAttention's kernels tile "
                f"a page by 16 keys or more), got {config.block_size}"
            )
        self._cuda_graphs = uses_cuda_graphs(self.compile, config.compile_backend, device)
        if self.compile:
            self._decode_model, self._decode_step = compile_decode(self.model, config.compile_backend, device)
        else:
            self._decode_step = decode_step
        self.num_blocks = config.num_blocks or blocks_from_memory(
            self.device, config.kv_cache_memory_fraction, self._bytes_per_block()
        )
        self.pool: KVCachePool | None = None
        self.allocator: BlockAllocator | None = None
        self._offloaded: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._base_loaded = False  # the frozen parameters hold the trainer's values (`load_weights`)
        self.wake()

    def _build_model(self, tp_mesh: DeviceMesh | None, ep_mesh: DeviceMesh | None) -> Transformer:
        with torch.device("meta"):
            model = Transformer(self.args)
            if self.lora is not None:
                add_lora(model, self.lora)  # same names and shards as the trainer's adapters
        if tp_mesh is not None and self.tp > 1:
            apply_tp(model, tp_mesh, sequence_parallel=False)
        if ep_mesh is not None:
            apply_ep(model, ep_mesh)  # each rank holds its experts, as the trainer's same rank
        model.to_empty(device=self.device)
        model.init_weights(buffer_device=self.device)
        model = model.to(self.dtype).eval().requires_grad_(False)
        if self.quantizer is not None:
            self.quantizer.quantize_model_(model)  # quantised tensors allocated once; syncs rewrite them
        return model

    # ---- memory: time-slicing with the trainer ----

    def _bytes_per_block(self) -> int:
        return KVCachePool.bytes_per_block(
            self.args.n_layers, self.config.block_size, self.args.n_kv_heads // self.tp, self.args.head_dim, self.dtype
        )

    def wake(self) -> None:
        """Allocate the KV pool (empty: prefix cache entries do not survive a sleep) and bring
        offloaded weights back."""
        for local, host in self._offloaded:
            local.data = host.to(self.device)
        self._offloaded = []
        if self.pool is None:
            return_freed_host_memory()  # what training freed, before the pool takes its place
            kv_heads = self.args.n_kv_heads // self.tp
            # One extra block, never handed out, takes the K/V writes of padding rows.
            self.pool = KVCachePool(
                self.args.n_layers,
                self.num_blocks + 1,
                self.config.block_size,
                kv_heads,
                self.args.head_dim,
                self.dtype,
                self.device,
            )
            self.allocator = BlockAllocator(self.num_blocks, self.config.enable_prefix_caching)
            self.block_routes: dict[int, torch.Tensor] = {}  # `routes.record_prefill_routes`
            if self._cuda_graphs:
                static_kv_for_cuda_graphs(self.pool.k, self.pool.v)

    def sleep(self, offload_weights: bool = False) -> None:
        """Free the KV pool so training can use the memory; optionally move the weights to host
        memory too (on a CPU device they already are, and stay put)."""
        self.pool = None
        self.allocator = None
        if offload_weights and self.device.type != "cpu" and not self.shares_weights:
            for local in weight_storage(self.model):
                self._offloaded.append((local, local.data.to("cpu", non_blocking=True)))
                local.data = torch.empty(0, dtype=local.dtype, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return_freed_host_memory()

    @property
    def kv_cache_bytes(self) -> int:
        return self.pool.nbytes if self.pool is not None else 0

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

    # ---- generation ----

    def _validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        params.validate()
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer= to the Generator")
        validate_prompts(prompts, self.args.max_seq_len, self.args.vocab_size)
        for i, prompt in enumerate(prompts):
            self._check_pool_fits(i, len(prompt), params.max_new_tokens)

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
        resume: list[ResumedSample] = (),
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
        try:
            self._validate(prompts, params)
            if (resume or pause_when is not None or on_finish is not None) and turns is not None:
                raise ValueError("pause / resume and on_finish do not support multi-turn environments")
            for r in resume:
                r.validate(len(prompts[r.prompt_index]), self.args.max_seq_len)
        except ValueError:
            if self.lockstep is not None:  # the peers must not wait for this rank's forwards
                self.lockstep.agree(ok=False)
            raise
        if self.lockstep is not None:
            self.lockstep.agree(ok=True)
        prompt_ids = list(range(len(prompts))) if prompt_ids is None else prompt_ids
        if self.pool is None:
            raise RuntimeError("generate() on a sleeping generator: call wake() first")
        start, compile_start = time.perf_counter(), compile_seconds()
        sched = Scheduler(
            self.pool,
            self.allocator,
            self.config,
            prompts,
            prompt_ids,
            params,
            max_seq_len=self.args.max_seq_len,
            vocab_size=self.args.vocab_size,
            turns=turns,
            resume=resume,
        )
        self._run(sched, turns, pause_when, on_finish)
        results = sched.results()
        sched.stats.seconds = time.perf_counter() - start
        sched.stats.compile_seconds = compile_seconds() - compile_start
        return [seq.to_completion(self.tokenizer) for seq in results], sched.stats

    def _run(
        self,
        sched: Scheduler,
        turns: TurnHandler | None,
        pause_when: PauseWhen | None,
        on_finish: Callable[[list[Completion]], None] | None,
    ) -> None:
        """Scheduler passes until every sample finished or paused: admit and prefill while there is
        room, else decode (both while a long context is prefilled chunk by chunk); report finished
        samples to `on_finish` after each pass."""
        reported = 0
        # Under expert parallelism: while any ep rank has work; a rank without serves the peers' all-to-alls.
        while sched.has_work if self.lockstep is None else self.lockstep.more_passes(sched.has_work):
            if not sched.has_work:
                continue
            sched.stats.steps += 1
            sched.stats.scheduler_passes += 1
            if turns is not None and not sched.exchange_turns():
                continue
            prefill = sched.admit()
            if prefill:
                with torch.profiler.record_function("generator/prefill"):
                    self._prefill(sched, prefill)
            if not prefill or sched.prefilling:
                # A chunked prefill continues next pass: the running samples decode in between.
                sched.stats.steps += bool(prefill)
                self._decode(sched, turns)
            if turns is not None:
                sched.pause()
            if (
                pause_when is not None
                and sched.has_work
                and pause_when([(s.prompt_index, s.sample_index) for s in sched.finished], sched.stats)
            ):
                sched.pause_all()
            if on_finish is not None:  # single-turn: `finished` only grows
                on_finish(
                    [s.to_completion(self.tokenizer) for s in sched.finished[reported:] if s.finish_reason != "paused"]
                )
                reported = len(sched.finished)

    def _prefill(self, sched: Scheduler, seqs: list[Seq]) -> None:
        """One packed forward over this step's context tokens of the admitted sequences (up to
        `prefill_end`: a chunk of a long context attends to the K/V its earlier chunks left in the
        blocks); each group prompt's last row then gives its samples their first token."""
        slices, tokens, last_index, starts, row = [], [], [], [], {}
        for seq in seqs:
            end = seq.prefill_end
            new = seq.token_ids[seq.num_computed : end]
            starts.append(seq.num_computed)
            slices.append(SeqSlice(seq.block_table, end, len(new)))
            tokens.extend(new)
            if end == seq.context_end:  # the last chunk: its last row is sampled
                row[id(seq)] = len(last_index)
                last_index.append(len(tokens) - 1)
            sched.stats.prefill_tokens += len(new)
            seq.num_computed = end
        # Logits only at each finished context's last token: the rows that are sampled (a full
        # [prompt tokens, vocab] projection would dominate prefill memory at a real vocabulary).
        logits_SV = self._forward(slices, tokens, logits_at=last_index)
        if self.record_routes:
            counts, B = [s.num_new for s in slices], self.config.block_size
            record_prefill_routes(seqs, starts, counts, self.model.moe_routes(), self.block_routes, B)
        samples, rows = [], []
        for seq in seqs:
            forked = sched.after_prefill(seq)
            samples.extend(forked)
            rows.extend(row[id(seq)] for _ in forked)
        if samples:
            self._sample(sched, samples, logits_SV[rows])

    def _decode(self, sched: Scheduler, turns: TurnHandler | None) -> None:
        """Tokens for every running sequence (preempting some if blocks run out): several steps
        on device per scheduler pass (`decode.py`), or one step when a stop needs the host
        (stop strings, multi-turn) or the step is not the tensor-only kind (top logprobs)."""
        batch = sched.schedule_decode()
        if not batch:
            return
        params = batch[0].params
        if turns is not None or params.stop_strings or params.num_top_logprobs:
            return self._decode_one_step(sched, batch)
        steps, left = sched.reserve_ahead(batch, self.config.decode_steps_per_schedule)
        stop_ids = sorted(self.eos_ids | set(params.stop_token_ids))
        rows = DecodeRows(
            tokens=[s.token_ids[-1] for s in batch],
            positions=[len(s.token_ids) - 1 for s in batch],
            left=left,
            keys=[s.key for s in batch],
            tables=[s.block_table for s in batch],
        )
        compiled = self._decode_step is not decode_step
        bucket = batch_bucket(len(batch)) if compiled else len(batch)
        with torch.profiler.record_function("generator/decode"):
            out = run_decode_pass(
                self._decode_step if self.lockstep is None else with_tick(self._decode_step, self.lockstep),
                self.model,
                self.pool.k,
                self.pool.v,
                params,
                rows,
                steps=steps,
                bucket=bucket,
                stop_ids=stop_ids,
                scratch=self.num_blocks,
                end_when_any_stops=bool(sched.waiting),
                device=self.device,
                attention=self.attention if compiled else self.eager_attention,
                cuda_graphs=self._cuda_graphs,
                record_routes=self.record_routes,
            )
        sched.stats.steps += out.steps - 1
        sched.stats.decode_steps += out.steps
        for i, (seq, tokens, logprobs, stopped) in enumerate(zip(batch, out.tokens, out.logprobs, out.stopped)):
            if out.routes is not None:
                add_route_chunk(seq, len(seq.token_ids) - 1, out.routes[i])
            seq.token_ids.extend(tokens)
            seq.logprobs.extend(logprobs)
            seq.num_computed = len(seq.token_ids) - 1
            sched.stats.decode_tokens += len(tokens)
            reason = ("stop" if tokens[-1] in stop_ids else "length") if stopped else None
            if reason is None:
                sched.trim_blocks(seq)
            sched.after_sample(seq, reason)

    def _decode_one_step(self, sched: Scheduler, batch: list[Seq]) -> None:
        slices = [SeqSlice(s.block_table, len(s.token_ids), 1) for s in batch]
        with torch.profiler.record_function("generator/decode"):
            logits_NV = self._forward(slices, [s.token_ids[-1] for s in batch], decode=True)
        if self.record_routes:
            starts = [len(s.token_ids) - 1 for s in batch]
            record_packed_routes(batch, starts, [1] * len(batch), self.model.moe_routes())
        sched.stats.decode_tokens += len(batch)
        sched.stats.decode_steps += 1
        for seq in batch:
            seq.num_computed = len(seq.token_ids)
        self._sample(sched, batch, logits_NV)

    def _forward(
        self, slices: list[SeqSlice], tokens: list[int], decode: bool = False, logits_at: list[int] | None = None
    ) -> torch.Tensor:
        """Logits [N, vocab] for the packed new tokens of `slices`, or only at the packed
        positions `logits_at` ([len(logits_at), vocab])."""
        model = self.model
        n = len(tokens)
        if self.lockstep is not None:
            self.lockstep.before_forward()
        if decode and self.compile:
            # Pad to a power-of-two batch with 1-token rows writing into the scratch block.
            bucket = batch_bucket(n)
            scratch = SeqSlice([self.num_blocks], 1, 1)
            slices = slices + [scratch] * (bucket - n)
            tokens = tokens + [0] * (bucket - n)
            model = self._decode_model
        attention = self.attention if model is not self.model else self.eager_attention
        num_pages = self.pool.num_blocks if attention == "flex" else None
        batch = PagedBatch.from_slices(slices, self.num_blocks, self.config.block_size, self.device, num_pages)
        backend = paged_attention(attention, batch, self.pool.k, self.pool.v)
        tokens_1N = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(0)
        if model is not self.model:
            # The context length changes every step; keep it symbolic instead of recompiling.
            torch._dynamo.mark_dynamic(batch.table_SM, 1)
        with batch_invariant_mode() if self.config.batch_invariant else contextlib.nullcontext():
            if logits_at is None:
                return model(tokens_1N, batch.positions_1N, backend)[0, :n]
            h_ND = model.hidden_states(tokens_1N, batch.positions_1N, backend)[0]
            return model.output(h_ND[logits_at])

    def _sample(self, sched: Scheduler, seqs: list[Seq], logits_NV: torch.Tensor) -> None:
        """Sample the next token of each seq from its row of `logits_NV`; the scheduler keeps it
        running or retires it."""
        with torch.profiler.record_function("generator/sample"):
            keys_N = torch.tensor([seq.key for seq in seqs], device=logits_NV.device)
            counters_N = torch.tensor([len(seq.token_ids) for seq in seqs], device=logits_NV.device)
            tokens_N = sample_tokens(logits_NV, seqs[0].params, keys_N, counters_N)
            logprobs_N = sampled_logprobs(logits_NV, tokens_N).tolist()
            tokens = tokens_N.tolist()
        num_top = seqs[0].params.num_top_logprobs
        if num_top:
            top = torch.log_softmax(logits_NV.float(), -1).topk(num_top)
            top_ids, top_lps = top.indices.tolist(), top.values.tolist()
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.token_ids.append(token)
            seq.logprobs.append(logprobs_N[i])
            if num_top:
                seq.top_logprobs.append(list(zip(top_ids[i], top_lps[i])))
            sched.after_sample(seq, self._finish_reason(seq, token))

    def _finish_reason(self, seq: Seq, token: int) -> str | None:
        if token in self.eos_ids or token in seq.params.stop_token_ids:
            return "stop"
        if seq.params.stop_strings:
            text = self.tokenizer.decode(seq.turn_token_ids)
            if any(s in text for s in seq.params.stop_strings):
                return "stop"
        if seq.num_generated >= seq.params.max_new_tokens or len(seq.token_ids) >= self.args.max_seq_len:
            return "length"
        return None
