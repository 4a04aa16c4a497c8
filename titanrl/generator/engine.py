"""The in-process generator: the trainer's model code over a paged KV cache.

`generate` runs continuous batching: groups of `n` samples are admitted while KV blocks are
free, their prompt is prefilled once and its blocks are shared by the samples (copy-on-write
for the partly filled last block), all running samples decode together, finished ones leave and
waiting ones join, and when blocks run out the youngest sample is preempted and later
recomputed. Every rank of a TP group runs the same schedule on its shard of heads.
"""

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate
from torch import nn

from titanrl.distributed.parallelize import apply_tp
from titanrl.generator.kv_cache import BlockAllocator, KVCachePool, OutOfBlocks, block_hashes
from titanrl.generator.paged_attention import PagedAttention, SeqSlice
from titanrl.generator.sampling import SamplingParams, sample_token, sampled_logprobs
from titanrl.models.args import TransformerModelArgs
from titanrl.models.batch_invariant import batch_invariant_mode
from titanrl.models.hf import load_hf_weights
from titanrl.models.model import Transformer
from titanrl.models.tokenizer import Tokenizer


@dataclass
class GeneratorOptions:
    block_size: int = 16
    num_blocks: int = 0
    """KV blocks in the pool; 0 sizes the pool from `memory_fraction` of free memory."""
    memory_fraction: float = 0.3
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    """Most prompt tokens prefilled in one step (a longer prompt is prefilled alone)."""
    enable_prefix_caching: bool = True
    eos_id: int | None = None
    batch_invariant: bool = False
    """Batch-invariant kernels: logprobs bitwise equal to the trainer's in the same mode (slow)."""
    compile: bool = False
    """Compile the decode step; batches are padded to power-of-two sizes so that each size
    compiles once (CUDA graphs via mode='reduce-overhead' on GPU)."""
    compile_backend: str = "inductor"
    attention_impl: str = "sdpa"
    """'sdpa': gather pages + SDPA (portable); 'flex': FlexAttention with a page block mask (GPU)."""


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    text: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    model_mask: list[int] | None = None
    """Multi-turn only: 1 for tokens the model sampled, 0 for environment tokens (logprob 0)."""


class TurnHandler(Protocol):
    """Drives multi-turn generation (see `titanrl/envs/rollout.py`). A sample that stops
    (eos, stop string, length) is handed to `submit` and keeps its KV blocks while its
    environment step runs; the other samples keep decoding. `poll` returns the steps that are
    done: (key, observation token ids) resumes the sample after appending them, (key, None)
    ends it. `key` is (prompt_index, sample_index)."""

    def submit(self, key: tuple[int, int], turn_token_ids: list[int], finish_reason: str) -> None: ...

    def poll(self, block: bool) -> list[tuple[tuple[int, int], list[int] | None]]: ...


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    """Tokens whose KV was computed in prefill (prompts once per group, plus recomputation)."""
    prefix_cache_hit_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    resumed_turns: int = 0
    """Multi-turn: turns resumed after an environment step, with their KV blocks kept."""
    steps: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Seq:
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    rng: torch.Generator | None
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    # A group's prompt before its samples are forked off; it samples n first tokens.
    is_group_prompt: bool = False
    # Multi-turn: where the current model turn began, and 1/0 per completion token (sampled by
    # the model / appended by the environment).
    turn_start: int = 0
    model_mask: list[int] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        """Tokens of the current turn (the whole completion when single-turn)."""
        return len(self.token_ids) - max(self.prompt_len, self.turn_start)


class Generator:
    def __init__(
        self,
        model_args: TransformerModelArgs,
        options: GeneratorOptions,
        device: torch.device,
        tp_mesh: DeviceMesh | None = None,
        tokenizer: Tokenizer | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.args = model_args
        self.options = options
        self.device = device
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.eos_id = options.eos_id if options.eos_id is not None else getattr(tokenizer, "eos_id", None)
        self.tp = tp_mesh.size() if tp_mesh is not None else 1
        with torch.device("meta"):
            model = Transformer(model_args)
        if tp_mesh is not None and self.tp > 1:
            apply_tp(model, tp_mesh, sequence_parallel=False)
        model.to_empty(device=device)
        model.init_weights(buffer_device=device)
        self.model = model.to(dtype).eval().requires_grad_(False)
        if options.compile and options.batch_invariant:
            raise ValueError("generator compile and batch_invariant cannot be combined; pick one")
        self._decode_model = self.model
        if options.compile:
            mode = "reduce-overhead" if device.type == "cuda" else None
            self._decode_model = torch.compile(self.model, backend=options.compile_backend, mode=mode)
        self.num_blocks = options.num_blocks or self._blocks_from_memory()
        self.pool: KVCachePool | None = None
        self.allocator: BlockAllocator | None = None
        self._multi_turn = False
        self._offloaded: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.wake()

    # ---- memory: time-slicing with the trainer ----

    def _bytes_per_block(self) -> int:
        return KVCachePool.bytes_per_block(
            self.args.n_layers, self.options.block_size, self.args.n_kv_heads // self.tp, self.args.head_dim, self.dtype
        )

    def _blocks_from_memory(self) -> int:
        if self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
        else:
            free_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return max(1, int(free_bytes * self.options.memory_fraction) // self._bytes_per_block())

    def wake(self) -> None:
        """Allocate the KV pool (empty: prefix cache entries do not survive a sleep) and bring
        offloaded weights back."""
        for local, host in self._offloaded:
            local.data = host.to(self.device)
        self._offloaded = []
        if self.pool is None:
            kv_heads = self.args.n_kv_heads // self.tp
            # One extra block, never handed out, takes the K/V writes of padding rows.
            self.pool = KVCachePool(
                self.args.n_layers, self.num_blocks + 1, self.options.block_size, kv_heads, self.args.head_dim,
                self.dtype, self.device, zero_all=self.options.attention_impl == "flex",
            )
            self.allocator = BlockAllocator(self.num_blocks, self.options.enable_prefix_caching)

    def sleep(self, offload_weights: bool = False) -> None:
        """Free the KV pool so training can use the memory; optionally move the weights to host
        memory too (on a CPU device they already are, and stay put)."""
        self.pool = None
        self.allocator = None
        if offload_weights and self.device.type != "cpu":
            for p in self.model.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                self._offloaded.append((local, local.data.to("cpu", non_blocking=True)))
                local.data = torch.empty(0, dtype=local.dtype, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def kv_cache_bytes(self) -> int:
        return self.pool.nbytes if self.pool is not None else 0

    # ---- weights ----

    @torch.no_grad()
    def load_weights(self, trainer_model: nn.Module) -> None:
        """Copy the trainer's current weights into this generator's tensors, in place.

        FSDP2 units are unsharded once each (one all-gather per unit, not per parameter), which
        leaves TP shards in place: a TP shard lands on the generator's matching TP shard.
        Transiently the ranks hold the unsharded trainer weights.
        """
        fsdp_units = [m for m in trainer_model.modules() if isinstance(m, FSDPModule)]
        for unit in fsdp_units:
            unit.unshard()
        try:
            self._copy_weights(trainer_model)
        finally:
            for unit in fsdp_units:
                unit.reshard()
        # Cached prefix blocks hold K/V computed with the old weights.
        if self.allocator is not None:
            self.allocator.reset_prefix_cache()

    def _copy_weights(self, trainer_model: nn.Module) -> None:
        dst_params = dict(self.model.named_parameters())
        for name, src in trainer_model.named_parameters():
            name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
            dst = dst_params.pop(name, None)
            if dst is None:
                raise ValueError(f"trainer parameter '{name}' has no counterpart in the generator")
            src_local = _gather_data_parallel(src.detach())
            dst_local = dst.to_local() if isinstance(dst, DTensor) else dst
            if src_local.shape != dst_local.shape:
                raise ValueError(
                    f"'{name}': trainer shard {tuple(src_local.shape)} != generator shard "
                    f"{tuple(dst_local.shape)}; trainer and generator must use the same tp degree"
                )
            dst_local.copy_(src_local)
        assert not dst_params, f"generator parameters not synced: {sorted(dst_params)}"

    def load_hf(self, folder: str) -> None:
        """Load weights from an HF safetensors folder (standalone use, without a trainer)."""
        load_hf_weights(self.model, folder)
        if self.allocator is not None:
            self.allocator.reset_prefix_cache()

    # ---- generation ----

    def _validate(self, prompts: list[list[int]], params: SamplingParams) -> None:
        params.validate()
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass tokenizer= to the Generator")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if len(prompt) >= self.args.max_seq_len:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens but the model context is {self.args.max_seq_len}; "
                    "shorten the prompt or raise model.max_seq_len"
                )
            if any(not 0 <= t < self.args.vocab_size for t in prompt):
                raise ValueError(f"prompt {i} has token ids outside [0, {self.args.vocab_size})")
            total = min(len(prompt) + params.max_new_tokens, self.args.max_seq_len)
            needed = math.ceil(total / self.options.block_size)
            if needed > self.num_blocks:
                raise ValueError(
                    f"the KV pool has {self.num_blocks} blocks of {self.options.block_size} tokens, but prompt {i} "
                    f"with max_new_tokens={params.max_new_tokens} needs {needed} blocks "
                    f"({needed * self._bytes_per_block()} bytes); raise generator.num_blocks or the memory fraction"
                )

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, prompt_ids: list[int] | None = None,
        turns: TurnHandler | None = None,
    ) -> tuple[list[Completion], GenerationStats]:
        """Generate `params.n` samples per prompt. Results are ordered by (prompt, sample).

        Sample j of prompt i draws from a random stream seeded by (params.seed, prompt_ids[i], j);
        passing global prompt ids makes samples independent of how prompts are split over ranks.
        With `turns`, samples are multi-turn episodes (`TurnHandler`); max_new_tokens is per turn.
        """
        self._validate(prompts, params)
        prompt_ids = list(range(len(prompts))) if prompt_ids is None else prompt_ids
        if self.pool is None:
            raise RuntimeError("generate() on a sleeping generator: call wake() first")
        stats = GenerationStats(prompt_tokens=sum(len(p) for p in prompts))
        start = time.perf_counter()
        waiting: list[_Seq] = [
            _Seq(i, 0, list(p), len(p), params, None, is_group_prompt=True) for i, p in enumerate(prompts)
        ]
        running: list[_Seq] = []
        finished: list[_Seq] = []
        paused: dict[tuple[int, int], _Seq] = {}
        self._multi_turn = turns is not None
        seed = params.seed if params.seed is not None else 0
        while waiting or running or paused:
            stats.steps += 1
            if turns is not None:
                self._resume(turns, paused, waiting, finished, stats, block=not (waiting or running))
                self._pause(turns, finished, paused)
                if not (waiting or running):
                    continue
            prefill = self._admit(waiting, running, params)
            if prefill:
                self._prefill(prefill, running, finished, stats, seed, prompt_ids)
            else:
                self._decode(waiting, running, finished, stats)
            if turns is not None:
                self._pause(turns, finished, paused)
        assert all(rc == 0 for rc in self.allocator.ref_count), "KV blocks leaked"
        stats.seconds = time.perf_counter() - start
        finished.sort(key=lambda s: (s.prompt_index, s.sample_index))
        return [self._completion(s) for s in finished], stats

    def _pause(self, turns: TurnHandler, finished: list[_Seq], paused: dict) -> None:
        """Hand samples whose turn just ended to the environment; they keep their KV blocks."""
        for seq in [s for s in finished if s.finish_reason is not None and not s.finish_reason.startswith("done")]:
            finished.remove(seq)
            key = (seq.prompt_index, seq.sample_index)
            paused[key] = seq
            turns.submit(key, seq.token_ids[max(seq.prompt_len, seq.turn_start) :], seq.finish_reason)

    def _resume(self, turns: TurnHandler, paused: dict, waiting: list[_Seq], finished: list[_Seq],
                stats: GenerationStats, block: bool) -> None:
        """Append environment observations and send the samples back to the scheduler; samples
        whose episode is over are finished and their blocks freed."""
        for key, obs in turns.poll(block):
            seq = paused.pop(key)
            if obs is None or len(seq.token_ids) + len(obs) >= self.args.max_seq_len:
                seq.finish_reason = "done:" + seq.finish_reason if obs is None else "done:length"
                for b in seq.block_table:
                    self.allocator.free(b)
                seq.block_table = []
                finished.append(seq)
                continue
            if any(not 0 <= t < self.args.vocab_size for t in obs) or not obs:
                raise ValueError(f"observation for sample {key} has no tokens or ids outside the vocabulary")
            # Tokens since the last observation were sampled by the model.
            seq.model_mask.extend([1] * (len(seq.token_ids) - seq.prompt_len - len(seq.model_mask)))
            seq.token_ids.extend(obs)
            seq.logprobs.extend([0.0] * len(obs))
            seq.model_mask.extend([0] * len(obs))
            seq.turn_start = len(seq.token_ids)
            seq.finish_reason = None
            stats.resumed_turns += 1
            # The sampled last token and the observation (but its last token) are prefilled;
            # the earlier turns' K/V stay in the sample's blocks.
            waiting.insert(0, seq)

    def _admit(self, waiting: list[_Seq], running: list[_Seq], params: SamplingParams) -> list[_Seq]:
        """Move waiting sequences whose prompt fits into blocks, up to the per-step token budget."""
        admitted, budget = [], self.options.max_num_batched_tokens
        num_seqs = len(running)  # sequences decoding once this step's admissions have forked
        while waiting:
            seq = waiting[0]
            n_after = params.n if seq.is_group_prompt else 1
            if num_seqs + n_after > self.options.max_num_seqs:
                break
            to_compute = len(seq.token_ids) - (0 if seq.is_group_prompt else 1)
            new_tokens = to_compute - seq.num_computed if seq.block_table else to_compute
            if admitted and new_tokens > budget:
                break
            # Blocks for the context, plus one per sample to start decoding, must be free now.
            needed = math.ceil(to_compute / self.options.block_size) + n_after - len(seq.block_table)
            if needed > self.allocator.num_free and (admitted or running):
                break
            try:
                if seq.block_table:
                    self._extend_context(seq, to_compute)
                else:
                    self._allocate_context(seq, to_compute)
            except OutOfBlocks:
                if admitted or running:
                    break
                raise
            admitted.append(waiting.pop(0))
            budget -= new_tokens
            num_seqs += n_after
        return admitted

    def _allocate_context(self, seq: _Seq, num_tokens: int) -> None:
        """Block table for the first `num_tokens` tokens, reusing cached full prompt blocks."""
        B = self.options.block_size
        hashes = block_hashes(seq.token_ids[: seq.prompt_len], B)
        # Keep at least one token to compute: its logits start (or resume) the sample.
        max_cached = (num_tokens - 1) // B
        table: list[int] = []
        try:
            for h in hashes[:max_cached]:
                block = self.allocator.lookup(h)
                if block is None:
                    break
                table.append(block)
            seq.num_computed = len(table) * B
            while len(table) * B < num_tokens:
                table.append(self.pool.prepare(self.allocator.allocate()))
        except OutOfBlocks:
            for block in table:
                self.allocator.free(block)
            seq.num_computed = 0
            raise
        seq.block_table = table

    def _extend_context(self, seq: _Seq, num_tokens: int) -> None:
        """A resumed multi-turn sample keeps its blocks; add blocks up to `num_tokens` and make
        the block it writes into first its own (it may still be shared with the group)."""
        B = self.options.block_size
        first = seq.num_computed // B
        if first < len(seq.block_table) and self.allocator.ref_count[seq.block_table[first]] > 1:
            block = seq.block_table[first]
            new_block = self.pool.prepare(self.allocator.allocate())
            self.pool.copy_block(block, new_block)
            self.allocator.free(block)
            seq.block_table[first] = new_block
        while len(seq.block_table) * B < num_tokens:
            seq.block_table.append(self.pool.prepare(self.allocator.allocate()))

    def _forward(self, slices: list[SeqSlice], tokens: list[int], decode: bool = False) -> torch.Tensor:
        """Logits [N, vocab] for the packed new tokens of `slices`."""
        model = self.model
        n = len(tokens)
        if decode and self.options.compile:
            # Pad to a power-of-two batch with 1-token rows writing into the scratch block.
            bucket = 1 << (n - 1).bit_length()
            scratch = SeqSlice([self.num_blocks], 1, 1)
            slices = slices + [scratch] * (bucket - n)
            tokens = tokens + [0] * (bucket - n)
            model = self._decode_model
        backend = PagedAttention(
            self.pool, slices, self.device, exact=self.options.batch_invariant, impl=self.options.attention_impl
        )
        tokens_1N = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(0)
        if model is not self.model:
            # The context length changes every step; keep it symbolic instead of recompiling.
            torch._dynamo.mark_dynamic(backend.gather_slots_SL, 1)
            torch._dynamo.mark_dynamic(backend.mask_S1QL, 3)
        with batch_invariant_mode() if self.options.batch_invariant else contextlib.nullcontext():
            return model(tokens_1N, backend.positions_1N, backend)[0, :n]

    def _prefill(self, seqs: list[_Seq], running, finished, stats: GenerationStats, seed: int, prompt_ids) -> None:
        slices, tokens, last_index = [], [], []
        for seq in seqs:
            end = len(seq.token_ids) - (0 if seq.is_group_prompt else 1)
            new = seq.token_ids[seq.num_computed : end]
            if seq.is_group_prompt:
                stats.prefix_cache_hit_tokens += seq.num_computed
            slices.append(SeqSlice(seq.block_table, end, len(new)))
            tokens.extend(new)
            last_index.append(len(tokens) - 1)
            stats.prefill_tokens += len(new)
            seq.num_computed = end
        logits_NV = self._forward(slices, tokens)
        children, rows = [], []
        for seq, idx in zip(seqs, last_index):
            self._register_prompt_blocks(seq)
            if not seq.is_group_prompt:
                running.append(seq)  # resumed after preemption: its next token is already sampled
                continue
            for sample_index in range(seq.params.n):
                children.append(self._fork(seq, sample_index, hash((seed, prompt_ids[seq.prompt_index]))))
                rows.append(idx)
            for block in seq.block_table:
                self.allocator.free(block)
        if children:
            self._append_samples(children, logits_NV[rows], running, finished)

    def _fork(self, group: _Seq, sample_index: int, seed: int) -> _Seq:
        rng = None
        if group.params.temperature > 0:
            rng = torch.Generator(device="cpu")
            rng.manual_seed(hash((seed, sample_index)) & 0x7FFF_FFFF_FFFF_FFFF)
        return _Seq(
            group.prompt_index, sample_index, list(group.token_ids), group.prompt_len, group.params, rng,
            block_table=[self.allocator.fork(b) for b in group.block_table], num_computed=group.num_computed,
        )

    def _register_prompt_blocks(self, seq: _Seq) -> None:
        B = self.options.block_size
        full = min(seq.num_computed, seq.prompt_len) // B
        for block, h in zip(seq.block_table[:full], block_hashes(seq.token_ids[: full * B], B)):
            self.allocator.register(block, h)

    def _append_samples(self, seqs: list[_Seq], logits_NV: torch.Tensor, running, finished) -> None:
        """Sample the next token of each seq from its row of `logits_NV`; retire finished seqs."""
        greedy_N = torch.argmax(logits_NV, dim=-1).tolist()
        tokens = [
            greedy_N[i] if seq.params.temperature == 0 else sample_token(logits_NV[i], seq.params, seq.rng)
            for i, seq in enumerate(seqs)
        ]
        tokens_N = torch.tensor(tokens, device=logits_NV.device)
        logprobs_N = sampled_logprobs(logits_NV, tokens_N).tolist()
        num_top = seqs[0].params.num_top_logprobs
        if num_top:
            top = torch.log_softmax(logits_NV.float(), -1).topk(num_top)
            top_ids, top_lps = top.indices.tolist(), top.values.tolist()
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.token_ids.append(token)
            seq.logprobs.append(logprobs_N[i])
            if num_top:
                seq.top_logprobs.append(list(zip(top_ids[i], top_lps[i])))
            reason = self._finish_reason(seq, token)
            if reason is None:
                running.append(seq)
                continue
            seq.finish_reason = reason
            if not self._multi_turn:  # a multi-turn sample keeps its blocks for its next turn
                for block in seq.block_table:
                    self.allocator.free(block)
                seq.block_table = []
            finished.append(seq)

    def _finish_reason(self, seq: _Seq, token: int) -> str | None:
        if token == self.eos_id or token in seq.params.stop_token_ids:
            return "stop"
        if seq.params.stop_strings:
            text = self.tokenizer.decode(seq.token_ids[max(seq.prompt_len, seq.turn_start) :])
            if any(s in text for s in seq.params.stop_strings):
                return "stop"
        if seq.num_generated >= seq.params.max_new_tokens or len(seq.token_ids) >= self.args.max_seq_len:
            return "length"
        return None

    def _reserve_slot(self, seq: _Seq) -> None:
        """Make the block for the token at position len-1 writable by this sequence alone."""
        B = self.options.block_size
        pos = len(seq.token_ids) - 1
        if pos // B == len(seq.block_table):
            seq.block_table.append(self.pool.prepare(self.allocator.allocate()))
            return
        block = seq.block_table[pos // B]
        if self.allocator.ref_count[block] > 1:  # shared with the group: copy on write
            new_block = self.pool.prepare(self.allocator.allocate())
            self.pool.copy_block(block, new_block)
            self.allocator.free(block)
            seq.block_table[pos // B] = new_block

    def _preempt(self, seq: _Seq, waiting: list[_Seq], stats: GenerationStats) -> None:
        """Free all of `seq`'s blocks; it resumes later by recomputing its context."""
        for block in seq.block_table:
            self.allocator.free(block)
        seq.block_table, seq.num_computed = [], 0
        waiting.insert(0, seq)
        stats.preemptions += 1

    def _decode(self, waiting, running: list[_Seq], finished, stats: GenerationStats) -> None:
        batch: list[_Seq] = []
        while running:
            seq = running.pop(0)
            try:
                self._reserve_slot(seq)
                batch.append(seq)
            except OutOfBlocks:
                # Preempt the youngest sequence (the last one admitted) and retry this one.
                victims = running if running else batch
                assert victims, "a lone sequence ran out of blocks; _validate should have refused it"
                running.insert(0, seq)
                self._preempt(victims.pop(), waiting, stats)
        if not batch:
            return
        slices = [SeqSlice(s.block_table, len(s.token_ids), 1) for s in batch]
        logits_NV = self._forward(slices, [s.token_ids[-1] for s in batch], decode=True)
        stats.decode_tokens += len(batch)
        for seq in batch:
            seq.num_computed = len(seq.token_ids)
        self._append_samples(batch, logits_NV, running, finished)

    def _completion(self, seq: _Seq) -> Completion:
        ids = seq.token_ids[seq.prompt_len :]
        return Completion(
            prompt_index=seq.prompt_index,
            sample_index=seq.sample_index,
            token_ids=ids,
            logprobs=seq.logprobs,
            finish_reason=seq.finish_reason.removeprefix("done:"),
            text=self.tokenizer.decode(ids) if self.tokenizer is not None else None,
            top_logprobs=seq.top_logprobs if seq.params.num_top_logprobs else None,
            model_mask=(seq.model_mask + [1] * (len(ids) - len(seq.model_mask))) if seq.model_mask else None,
        )


def _gather_data_parallel(t: torch.Tensor) -> torch.Tensor:
    """Local tensor of `t` after all-gathering only its data-parallel mesh dims."""
    if not isinstance(t, DTensor):
        return t
    names = t.device_mesh.mesh_dim_names or ()
    placements = [
        Replicate() if i < len(names) and names[i] in ("dp_replicate", "dp_shard", "dp") else p
        for i, p in enumerate(t.placements)
    ]
    return t.redistribute(t.device_mesh, placements).to_local()
