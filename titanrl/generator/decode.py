"""The decode loop on device: the running samples decode several steps between two scheduler
passes, with their state in tensors.

A scheduler pass (host, Python) reserves KV blocks for the next `steps` tokens of every running
sample and uploads its state once: last token, position, block table, random key, tokens left.
Then each step runs on device without host bookkeeping: write K/V at the row's slot, attend over
its pages (`paged_attention.py`), sample (a stateless per-row stream, `sampling.counter_uniform`),
take the logprob, test eos / length for all rows at once. Rows that finish stop writing (their
slot becomes the scratch block) and are padding until the pass ends. The host reads one small scalar per step
(live rows) to end a pass early when many rows finished or waiting samples could be admitted,
and the tokens once per pass. With `compile`, the step (model, sampling, logprob, stop test) is
one compiled region per power-of-two batch bucket (CUDA graphs on GPU).
"""

import array
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from titanrl.generator.paged_attention import AttentionKind, PagedBatch, logical_page_index, paged_attention
from titanrl.generator.sampling import SamplingParams, sample_tokens, sampled_logprobs
from titanrl.models.batch_invariant import batch_invariant_mode
from titanrl.models.model import Transformer
from titanrl.models.moe import MoE

DecodeStepOutput = tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor | None,
]
"""`decode_step`'s tokens, positions, live, tokens left, logprobs, stopped, live count, routes or None."""


def decode_step(
    model: Transformer,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
    params: SamplingParams,
    tokens_N: torch.Tensor,
    pos_N: torch.Tensor,
    live_N: torch.Tensor,
    left_N: torch.Tensor,
    key_N: torch.Tensor,
    table_NM: torch.Tensor,
    page_index_P: torch.Tensor | None,
    stop_ids_E: torch.Tensor,
    scratch: int,
    attention: AttentionKind,
    record_routes: bool = False,
    window_table_NM: torch.Tensor | None = None,
    window_page_index_P: torch.Tensor | None = None,
    window_scratch: int = 0,
) -> DecodeStepOutput:
    """One token for every live row. Returns the next state (tokens, positions, live, tokens
    left), the sampled tokens' logprobs, which rows stopped at this step, how many rows are
    still live (0-d, the host's one read per step) and, with `record_routes`, each MoE layer's
    experts for the fed tokens [MoE layers, N, top_k] (else None). `attention` 'exact':
    batch-invariant mode (eager only). `window_table_NM` (sliding-window layers with a pool of
    their own, `window_pages.py`): the rows' window tables, with that pool's page index and scratch."""
    B = v_cache[0].shape[1]
    batch = PagedBatch.decode(table_NM, pos_N, live_N, scratch, B, page_index_P)
    window_batch = None
    if window_table_NM is not None:
        window_batch = PagedBatch.decode(window_table_NM, pos_N, live_N, window_scratch, B, window_page_index_P)
    backend = paged_attention(attention, batch, k_cache, v_cache, window_batch)
    with batch_invariant_mode() if attention == "exact" else contextlib.nullcontext():
        logits_NV = model(tokens_N.unsqueeze(0), pos_N.unsqueeze(0), backend)[0]
    # The counter is the drawn token's position: the same draw whatever the batching.
    next_N = sample_tokens(logits_NV, params, key_N, pos_N + 1)
    logprobs_N = sampled_logprobs(logits_NV, next_N)
    stopped_N = live_N & (torch.isin(next_N, stop_ids_E) | (left_N <= 1))
    next_live_N = live_N & ~stopped_N
    return (
        next_N,
        torch.where(next_live_N, pos_N + 1, pos_N),
        next_live_N,
        left_N - 1,
        logprobs_N,
        stopped_N,
        next_live_N.sum(),
        model.moe_routes() if record_routes else None,
    )


def uses_cuda_graphs(compile: bool, backend: str, device: torch.device) -> bool:
    """Whether the compiled prefill and decode step run as CUDA graphs (inductor on CUDA)."""
    return compile and backend == "inductor" and device.type == "cuda"


MIN_BUCKET = 8
"""Smallest batch bucket of the compiled decode step: buckets are the powers of two from here to
max_num_seqs (6 compiled graphs for 256 sequences), each with static shapes but for the block
tables' width (FlexAttention's flash-decoding kernel wants a static batch)."""


def batch_bucket(n: int) -> int:
    """The compiled decode step's batch for `n` rows (padding rows are dead)."""
    return max(MIN_BUCKET, 1 << (n - 1).bit_length())


def compile_decode(
    model: Transformer, backend: str, device: torch.device
) -> tuple[Transformer, Callable[..., DecodeStepOutput]]:
    """The compiled model (one-step decode) and decode step, static shapes per batch bucket (the
    block tables' width is marked dynamic). On CUDA, CUDA graphs (`reduce-overhead`'s option).
    Guards on modules are skipped: the generator's modules never change type or structure
    (weights are updated in place), and guarding on them costs Python time at every decode step."""
    options: dict = {"triton.cudagraphs": True} if uses_cuda_graphs(True, backend, device) else {}
    model_fn = torch.compile(model, backend=backend, options=dict(options) or None, dynamic=False)
    if not any(isinstance(m, MoE) for m in model.modules()):
        # Not with MoE layers: their data-dependent expert split breaks the graph, so each block's
        # frame is compiled on its own, and without module guards an MoE block and a dense block
        # would run each other's code.
        options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    if backend == "inductor":
        # No stride checks of the step's matmul / view outputs on every call (Python per step).
        options["size_asserts"] = False
    # The compiled module (an OptimizedModule) forwards every attribute to `model`.
    return cast(Transformer, model_fn), torch.compile(decode_step, backend=backend, options=options, dynamic=False)


def static_kv_for_cuda_graphs(k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]) -> None:
    """The compiled decode step writes K/V into the pool in place. CUDA graphs (inductor's
    cudagraph trees) run a step that mutates its inputs only when those inputs are static: else
    every step ran without a graph ("skipping cudagraphs due to mutated inputs", seen on an H200:
    qwen2.5-0.5b decode at batch 1 launch-bound at 167 tok/s). Each wake allocates a new pool;
    the graphs recorded on the old one are dropped (re-recorded at the next step of each bucket)
    instead of piling up as stale siblings that every step would check."""
    for t in (*k_cache, *v_cache):
        torch._dynamo.mark_static_address(t)
    from torch._inductor import cudagraph_trees

    cudagraph_trees.reset_cudagraph_trees()


@dataclass
class DecodeRows:
    """Host-side description of the rows of one pass (built by the engine from the scheduler)."""

    tokens: list[int]
    """Last token of each sample (fed at this pass's first step)."""
    positions: list[int]
    """Its position."""
    left: list[int]
    """Tokens each sample may still add (max_new_tokens, context length)."""
    keys: list[int]
    """Random-stream keys."""
    tables: list[list[int]]
    """Block tables, covering every position the pass may write."""
    window_tables: list[list[int]] | None = None
    """Sliding-window layers with a pool of their own: the window tables (`window_pages.py`)."""


@dataclass
class DecodeOutput:
    tokens: list[list[int]]
    """New tokens per row (only those before and including its stop)."""
    logprobs: list[list[float]]
    stopped: list[bool]
    """Whether the row stopped (eos / stop id / length) in this pass."""
    steps: int
    routes: list[torch.Tensor] | None = None
    """With route recording: per row, the experts of its fed tokens [new tokens, MoE layers, top_k]."""


class _TableWidths:
    """The block tables of a pass cut to the pages its rows can reach at each step: the pass
    reserves pages for all its steps, but attention at step s reads only up to position
    max(pos) + s, so the masked tail is never computed (at batch 256 over a 32-step pass, ~15%
    of the attention's work). One fresh row-major copy per width: views into `meta` have strides
    that change with the width, which the compiled step guards on; the width is marked dynamic
    (>= 2, off the 0/1 specialisation), so every width runs one compiled graph."""

    def __init__(self, table_NM: torch.Tensor, max_pos: int, block_size: int, dynamic: bool) -> None:
        self.full_NM, self.max_pos, self.block_size, self.dynamic = table_NM, max_pos, block_size, dynamic
        self.by_width: dict[int, torch.Tensor] = {}

    def at(self, step: int) -> torch.Tensor:
        M = self.full_NM.shape[1]
        width = min(M, max(2, (self.max_pos + step) // self.block_size + 1))
        if width not in self.by_width:
            table = torch.empty(self.full_NM.shape[0], width, dtype=torch.long, device=self.full_NM.device)
            table.copy_(self.full_NM[:, :width])
            if self.dynamic:
                torch._dynamo.mark_dynamic(table, 1)
            self.by_width[width] = table
        return self.by_width[width]


def _upload_tables(tables: list[list[int]], bucket: int, scratch: int, device: torch.device) -> torch.Tensor:
    """Block tables `[bucket, M]` padded with `scratch` (a window pool's, `_upload_rows` for the main one)."""
    M = max(2, max(len(t) for t in tables))
    flat: list[int] = []
    for table in tables:
        flat += table
        flat += [scratch] * (M - len(table))
    flat += [scratch] * M * (bucket - len(tables))
    return torch.frombuffer(array.array("q", flat), dtype=torch.long).to(device).view(bucket, M)


def _upload_rows(rows: DecodeRows, bucket: int, scratch: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The pass's state on the device: tokens, positions, tokens left and sampling keys `[bucket]`
    (padding rows dead: 1 token left), and the block tables `[bucket, M]` padded with `scratch`."""
    P = bucket - len(rows.tokens)
    M = max(2, max(len(t) for t in rows.tables))  # >= 2: keeps the dynamic width off 0/1 specialisation
    # One host buffer (built as one flat list: faster than a nested list into torch.tensor)
    # and one copy to the device: the state [4, bucket] (padding rows dead: 1 token left), then
    # the block tables [bucket, M] padded with the scratch block.
    pad = [scratch] * M
    flat = [*rows.tokens, *[0] * P, *rows.positions, *[0] * P, *rows.left, *[1] * P, *rows.keys, *[0] * P]
    for table in rows.tables:
        flat += table
        flat += pad[len(table) :]
    flat += pad * P
    meta = torch.frombuffer(array.array("q", flat), dtype=torch.long).to(device)
    # Fresh tensors, as the step's own outputs are at later steps: four views with offsets into
    # one storage would be inputs of another kind for the compiled step (guards, a recompile).
    tokens_N, pos_N, left_N, key_N = (
        torch.empty(bucket, dtype=torch.long, device=device).copy_(meta[i * bucket : (i + 1) * bucket])
        for i in range(4)
    )
    table_NM = meta[4 * bucket :].view(bucket, M)
    return tokens_N, pos_N, left_N, key_N, table_NM


def _collect(
    out_tokens: tuple[torch.Tensor, ...],
    out_logprobs: tuple[torch.Tensor, ...],
    out_stopped: tuple[torch.Tensor, ...],
    live_N: torch.Tensor,
    out_routes: tuple[torch.Tensor, ...],
) -> DecodeOutput:
    """The pass's per-step outputs read back once, each row cut after its stop token."""
    N = len(live_N)
    done = len(out_tokens)
    tokens = torch.stack(out_tokens)[:, :N].t().tolist()
    logprobs = torch.stack(out_logprobs)[:, :N].t().tolist()
    stopped_KN = torch.stack(out_stopped)[:, :N]
    lengths = [done] * N
    if stopped_KN.any():  # cut each stopped row after its stop (argmax finds the first True)
        lengths = torch.where(stopped_KN.any(0), stopped_KN.int().argmax(0) + 1, done).tolist()
        tokens = [t[:n] for t, n in zip(tokens, lengths)]
        logprobs = [lp[:n] for lp, n in zip(logprobs, lengths)]
    routes = None
    if out_routes:  # [steps, L, bucket, K] -> per row [its steps, L, K], int16 on the host
        routes_NSLK = torch.stack(out_routes)[:, :, :N].permute(2, 0, 1, 3).to(torch.int16).cpu()
        routes = [routes_NSLK[i, :n] for i, n in enumerate(lengths)]
    return DecodeOutput(
        tokens=tokens,
        logprobs=logprobs,
        stopped=(~live_N).tolist(),
        steps=done,
        routes=routes,
    )


def _device_tables(
    table_NM: torch.Tensor, scratch: int, max_pos: int, block_size: int, dynamic: bool, attention: AttentionKind
) -> tuple[_TableWidths, torch.Tensor | None]:
    """A pass's tables cut per step (`_TableWidths`) and, for FlexAttention, their pages'
    logical index: the pages keep it at every step, so it is computed once, an input of the
    step (the scratch block is the pool's last: the pool has scratch + 1 pages)."""
    page_index_P = logical_page_index(table_NM, scratch, scratch + 1) if attention == "flex" else None
    return _TableWidths(table_NM, max_pos, block_size, dynamic), page_index_P


class _WindowArgs:
    """`decode_step`'s window-pool arguments at each step of a pass: none without a window pool
    (`rows.window_tables` None), else the window tables (`_device_tables`) and scratch block."""

    def __init__(self, rows: DecodeRows, bucket: int, scratch: int, device: torch.device, tables_args: tuple) -> None:
        self.scratch, self.tables, self.page_index_P = scratch, None, None
        if rows.window_tables is not None:
            window_NM = _upload_tables(rows.window_tables, bucket, scratch, device)
            self.tables, self.page_index_P = _device_tables(window_NM, scratch, *tables_args)

    def kwargs(self, step: int) -> dict:
        if self.tables is None:
            return {}
        return dict(
            window_table_NM=self.tables.at(step), window_page_index_P=self.page_index_P, window_scratch=self.scratch
        )


def run_decode_pass(
    step_fn: Callable[..., DecodeStepOutput],
    model: Transformer,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
    params: SamplingParams,
    rows: DecodeRows,
    *,
    steps: int,
    bucket: int,
    stop_ids: list[int],
    scratch: int,
    end_when_any_stops: bool,
    device: torch.device,
    attention: AttentionKind,
    cuda_graphs: bool = False,
    record_routes: bool = False,
    window_scratch: int = 0,
) -> DecodeOutput:
    """Up to `steps` decode steps over `rows` padded to `bucket` rows (padding rows are dead
    from the start). Ends early when every row stopped, when a quarter stopped (their compute
    would be wasted), or at the first stop when `end_when_any_stops` (samples wait for room).
    `rows.window_tables`: over the window pool (`window_scratch` its scratch block)."""
    N = len(rows.tokens)
    tokens_N, pos_N, left_N, key_N, table_NM = _upload_rows(rows, bucket, scratch, device)
    live_N = torch.arange(bucket, device=device) < N
    stop_ids_E = torch.tensor(stop_ids, dtype=torch.long, device=device)
    B, dynamic, max_pos = v_cache[0].shape[1], step_fn is not decode_step, max(rows.positions)
    tables, page_index_P = _device_tables(table_NM, scratch, max_pos, B, dynamic, attention)
    window = _WindowArgs(rows, bucket, window_scratch, device, (max_pos, B, dynamic, attention))
    head, fixed = (model, k_cache, v_cache, params), (stop_ids_E, scratch, attention, record_routes)
    outs = []  # per step: tokens, logprobs, stopped, routes (or None)
    for step in range(steps):
        if cuda_graphs:  # CUDA graphs: the outputs kept below are copies, so the replay may reuse its buffers
            torch.compiler.cudagraph_mark_step_begin()
        tokens_N, pos_N, live_N, left_N, logprobs_N, stopped_N, num_live, routes_LNK = step_fn(
            *head,
            tokens_N,
            pos_N,
            live_N,
            left_N,
            key_N,
            tables.at(step),
            page_index_P,
            *fixed,
            **window.kwargs(step),
        )
        if cuda_graphs:  # a replay overwrites the previous one's outputs
            tokens_N, pos_N, live_N, left_N, logprobs_N, stopped_N = (
                t.clone() for t in (tokens_N, pos_N, live_N, left_N, logprobs_N, stopped_N)
            )
            routes_LNK = routes_LNK if routes_LNK is None else routes_LNK.clone()
        outs.append((tokens_N, logprobs_N, stopped_N, routes_LNK))
        live = int(num_live)  # the one host read per step
        if live == 0 or 4 * live <= 3 * N or (end_when_any_stops and live < N):
            break
    out_tokens, out_logprobs, out_stopped, out_routes = zip(*outs)
    return _collect(out_tokens, out_logprobs, out_stopped, live_N[:N], out_routes if record_routes else ())
