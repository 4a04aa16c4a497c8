"""The generator's copy of the policy and its forwards over the paged KV pool.

The model is built like the trainer's (TP-sharded, its experts EP-sharded, LoRA adapters with
the same names), optionally quantised. A forward is packed: the new tokens of every sequence in
one row, attending to their blocks of the pool. Decode steps run eagerly or compiled (CUDA graphs
where the backend allows); under expert parallelism every forward is in lockstep with the peers.
"""

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.config.model import LoRA as LoRAConfig
from titanrl.distributed.parallelize import apply_ep, apply_tp
from titanrl.generator.decode import (
    DecodeOutput,
    DecodeRows,
    batch_bucket,
    compile_decode,
    decode_step,
    run_decode_pass,
    uses_cuda_graphs,
)
from titanrl.generator.ep_lockstep import EPLockstep, with_tick
from titanrl.generator.kv_cache import KVCachePool
from titanrl.generator.paged_attention import PagedBatch, SeqSlice, attention_kinds, paged_attention
from titanrl.generator.routes import has_moe_layers
from titanrl.generator.sampling import SamplingParams
from titanrl.generator.state_slots import StateSlots
from titanrl.generator.weight_sync import build_quantizer
from titanrl.generator.window_pages import WindowPages
from titanrl.models.args import TransformerModelArgs
from titanrl.models.batch_invariant import batch_invariant_mode
from titanrl.models.gated_deltanet import check_parallelism
from titanrl.models.lora import add_lora
from titanrl.models.model import Transformer


class ModelRunner:
    """The policy copy (`model`), its compiled decode step and the attention kinds it runs with.
    The pool's last block is never handed out: padding rows write their K/V into it."""

    def __init__(
        self,
        model_args: TransformerModelArgs,
        config: GeneratorConfig,
        device: torch.device,
        dtype: torch.dtype,
        *,
        lora: LoRAConfig | None,
        tp_mesh: DeviceMesh | None,
        ep_mesh: DeviceMesh | None,
    ) -> None:
        self.args = model_args
        self.config = config
        self.state_slots: StateSlots | None = None
        """A hybrid model's recurrent-state slots, set by the generator while it is awake."""
        self.device = device
        self.dtype = dtype
        self.lora = lora
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
        self._decode_model: nn.Module = self.model
        # Unset: compiled on CUDA (never with batch_invariant, whose kernels run eagerly).
        auto_compile = device.type == "cuda" and not config.batch_invariant and not model_args.has_linear_layers
        if config.compile and model_args.has_linear_layers:
            raise ValueError(
                "[generator] compile = true is not supported for hybrid linear-attention models yet (their "
                "decode steps read per-sequence state slots eagerly): leave generator.compile unset or false"
            )
        if config.batch_invariant and model_args.has_linear_layers:
            raise ValueError(
                "[generator] batch_invariant = true is not supported for hybrid linear-attention models yet (decode "
                "steps the recurrence token by token, the trainer runs it in chunks of 64): set it to false"
            )
        self.compile = config.compile if config.compile is not None else auto_compile
        self.attention, self.eager_attention = attention_kinds(config, device, self.compile)
        if device.type == "cuda" and "flex" in (self.attention, self.eager_attention) and config.block_size % 16:
            raise ValueError(
                f"[generator] block_size must be a multiple of 16 on CUDA (FlexAttention's kernels tile "
                f"a page by 16 keys or more), got {config.block_size}"
            )
        self.cuda_graphs = uses_cuda_graphs(self.compile, config.compile_backend, device)
        if self.compile:
            self._decode_model, self._decode_step = compile_decode(self.model, config.compile_backend, device)
        else:
            self._decode_step = decode_step

    def _build_model(self, tp_mesh: DeviceMesh | None, ep_mesh: DeviceMesh | None) -> Transformer:
        with torch.device("meta"):
            model = Transformer(self.args)
            if self.lora is not None:
                add_lora(model, self.lora)  # same names and shards as the trainer's adapters
        check_parallelism(self.args, self.tp, 1)  # hybrid models: tp must divide the linear heads
        if tp_mesh is not None and self.tp > 1:
            apply_tp(model, tp_mesh, sequence_parallel=False)
        if ep_mesh is not None:
            apply_ep(model, ep_mesh)  # each rank holds its experts, as the trainer's same rank
        model.to_empty(device=self.device)
        model.init_weights(buffer_device=self.device)
        model.to(self.dtype).eval().requires_grad_(False)  # in place: a module's to() returns it
        if self.quantizer is not None:
            self.quantizer.quantize_model_(model)  # quantised tensors allocated once; syncs rewrite them
        return model

    def forward(
        self,
        pool: KVCachePool,
        slices: list[SeqSlice],
        tokens: list[int],
        decode: bool = False,
        logits_at: list[int] | None = None,
        state_slots: StateSlots | None = None,
        window: tuple[WindowPages, list[SeqSlice]] | None = None,
    ) -> torch.Tensor:
        """Logits [N, vocab] for the packed new tokens of `slices`, or only at the packed
        positions `logits_at` ([len(logits_at), vocab]). `state_slots`: a hybrid model's
        recurrent states, read and advanced at each slice's `state_slot`. `window`: the
        sliding-window layers' pages and the same slices over the sequences' window tables."""
        model: nn.Module = self.model
        n = len(tokens)
        scratch = pool.num_blocks - 1
        if self.lockstep is not None:
            self.lockstep.before_forward()
        if decode and self.compile:
            # Pad to a power-of-two batch with 1-token rows writing into the scratch block.
            bucket = batch_bucket(n)
            slices = slices + [SeqSlice([scratch], 1, 1)] * (bucket - n)
            if window is not None:
                window = window[0], window[1] + [SeqSlice([window[0].scratch], 1, 1)] * (bucket - n)
            tokens = tokens + [0] * (bucket - n)
            model = self._decode_model
        attention = self.attention if model is not self.model else self.eager_attention
        batch = self._batch(pool, slices, attention)
        if window is None:
            backend = paged_attention(attention, batch, pool.k, pool.v)
        else:
            window_batch = self._batch(window[0].pool, window[1], attention)
            backend = paged_attention(attention, batch, window[0].k, window[0].v, window_batch)
        if state_slots is not None:  # read by the linear layers (`TransformerBlock._mix`)
            backend.linear_states = state_slots.states([s.state_slot for s in slices], [s.num_new for s in slices])
        tokens_1N = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(0)
        if model is not self.model:
            # The context length changes every step; keep it symbolic instead of recompiling.
            torch._dynamo.mark_dynamic(batch.table_SM, 1)
            if backend.window_batch is not None:
                torch._dynamo.mark_dynamic(backend.window_batch.table_SM, 1)
        with batch_invariant_mode() if self.config.batch_invariant else contextlib.nullcontext():
            if logits_at is None:
                return model(tokens_1N, batch.positions_1N, backend)[0, :n]
            assert model is self.model, "logits at chosen rows: a prefill, never the compiled decode step"
            h_ND = self.model.hidden_states(tokens_1N, batch.positions_1N, backend)[0]
            return self.model.output(h_ND[logits_at])

    def _batch(self, pool: KVCachePool, slices: list[SeqSlice], attention: str) -> PagedBatch:
        """The forward's `PagedBatch` over `pool` (its last block the scratch block)."""
        num_pages = pool.num_blocks if attention == "flex" else None
        return PagedBatch.from_slices(slices, pool.num_blocks - 1, self.config.block_size, self.device, num_pages)

    def decode_pass(
        self,
        pool: KVCachePool,
        params: SamplingParams,
        rows: DecodeRows,
        *,
        steps: int,
        stop_ids: list[int],
        end_when_any_stops: bool,
        window: WindowPages | None = None,
    ) -> DecodeOutput:
        """Up to `steps` decode steps of `rows` on the device (`decode.run_decode_pass`);
        `window`: the sliding-window layers' pages (`rows.window_tables` index them)."""
        compiled = self._decode_step is not decode_step
        return run_decode_pass(
            self._decode_step if self.lockstep is None else with_tick(self._decode_step, self.lockstep),
            self.model,
            pool.k if window is None else window.k,
            pool.v if window is None else window.v,
            params,
            rows,
            steps=steps,
            bucket=batch_bucket(len(rows.tokens)) if compiled else len(rows.tokens),
            stop_ids=stop_ids,
            scratch=pool.num_blocks - 1,
            end_when_any_stops=end_when_any_stops,
            device=self.device,
            attention=self.attention if compiled else self.eager_attention,
            cuda_graphs=self.cuda_graphs,
            record_routes=self.record_routes,
            window_scratch=window.scratch if window is not None else 0,
        )
