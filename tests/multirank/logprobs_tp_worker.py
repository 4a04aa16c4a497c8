"""Vocab-parallel logprobs (`models/logprobs.py: vocab_parallel_token_logprobs`) on a tp mesh.

Launched by tests/test_logprobs.py with torchrun (2 gloo ranks). Every rank draws the same
random inputs, so each computes the full-logits float64 reference itself. Rank 0 writes the max
errors of each check as JSON; the test asserts on them.
"""

import argparse
import copy
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from titanrl.distributed import init_distributed
from titanrl.distributed.parallelize import apply_tp
from titanrl.models import Transformer, TransformerModelArgs
from titanrl.models.logprobs import vocab_parallel_token_logprobs

D = 24
# (V, B, T, chunk, layout of h): a toy vocabulary at chunk 1, 5 and > N, and the real one
# (Qwen's 151,936) with a few rows; h sequence-sharded as training has it, replicated, or plain.
CASES = [(194, 3, 11, chunk, "seq_sharded") for chunk in (1, 5, 1000)] + [
    (194, 3, 11, 5, "replicated"),
    (194, 3, 11, 5, "plain"),
    (151_936, 1, 6, 4, "seq_sharded"),
]


def _reference(h_BTD, w_VD, targets_BT):
    logp_BTV = torch.log_softmax(h_BTD @ w_VD.t(), -1)
    return logp_BTV.gather(-1, targets_BT[..., None]).squeeze(-1), -(logp_BTV.exp() * logp_BTV).sum(-1)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def function_errors(mesh, V, B, T, chunk, h_layout, masked, dtype=torch.float64) -> dict:
    """Max |error| of logprobs, entropy, grad h, grad W (inputs in `dtype`) against the float64
    reference."""
    g = torch.Generator().manual_seed(V + chunk)
    h = 0.5 * torch.randn(B, T, D, dtype=torch.float64, generator=g)
    w = 0.5 * torch.randn(V, D, dtype=torch.float64, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets.view(-1)[:4] = torch.tensor([0, V // 2 - 1, V // 2, V - 1])  # both shards, both edges
    upstream = torch.randn(B, T, dtype=torch.float64, generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.6).double() if masked else torch.ones(B, T, dtype=torch.float64)

    w_dt = distribute_tensor(w.to(dtype), mesh, [Shard(0)]).requires_grad_()
    if h_layout == "plain":
        h_in = h.to(dtype, copy=True).requires_grad_()
    else:
        h_in = distribute_tensor(
            h.to(dtype), mesh, [Shard(1) if h_layout == "seq_sharded" else Replicate()]
        ).requires_grad_()
    logprobs, entropy = vocab_parallel_token_logprobs(h_in, w_dt, targets, chunk, True, mask if masked else None)
    (logprobs * upstream).sum().backward()
    assert isinstance(w_dt.grad, DTensor) and tuple(w_dt.grad.placements) == (Shard(0),), w_dt.grad
    if h_layout != "plain":
        assert tuple(h_in.grad.placements) == tuple(h_in.placements), (h_in.grad.placements, h_in.placements)

    h64, w64 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref_logprobs, ref_entropy = _reference(h64, w64, targets)
    (ref_logprobs * mask * upstream).sum().backward()
    pairs = {
        "logprobs": (logprobs, ref_logprobs * mask),
        "entropy": (entropy, ref_entropy * mask),
        "grad_h": (_full(h_in.grad), h64.grad),
        "grad_w": (_full(w_dt.grad), w64.grad),
    }
    assert not entropy.requires_grad
    return {k: (a.double() - b.detach()).abs().max().item() for k, (a, b) in pairs.items()}


def empty_mask_ok(mesh) -> bool:
    """An all-zero mask projects no row: zeros, and a zero gradient (collectives on empty chunks)."""
    h = distribute_tensor(torch.randn(2, 4, D), mesh, [Shard(1)]).requires_grad_()
    w = distribute_tensor(torch.randn(10, D), mesh, [Shard(0)]).requires_grad_()
    logprobs, entropy = vocab_parallel_token_logprobs(
        h, w, torch.zeros(2, 4, dtype=torch.long), 3, True, torch.zeros(2, 4)
    )
    logprobs.sum().backward()
    return bool(
        (logprobs == 0).all() and (entropy == 0).all() and (_full(h.grad) == 0).all() and (_full(w.grad) == 0).all()
    )


class _VocabSizedOutputs(TorchDispatchMode):
    """Counts ops whose output has the full vocabulary as last dim (gathered logits)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size, self.hits = vocab_size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab_size:
                self.hits.append(str(func))
        return out


def model_errors(mesh, family: str) -> dict:
    """A tiny float64 Transformer under `apply_tp` (sequence parallel, as training uses) against
    its 1-rank copy: logprobs, entropy and every parameter gradient; and no full-vocab tensor."""
    args = TransformerModelArgs(
        family=family,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=48,
        vocab_size=250,
        qk_norm=family == "qwen3",
        qkv_bias=family == "qwen2",
        tie_word_embeddings=family == "qwen3",
        max_seq_len=32,
    )
    torch.manual_seed(0)
    ref = Transformer(args).double()
    ref.init_weights()
    model = copy.deepcopy(ref)
    apply_tp(model, mesh, sequence_parallel=True)
    assert (model.output.weight is model.tok_embeddings.weight) == args.ties_output
    model.output.forward = None  # the logits path must not be taken: calling it would fail
    tokens = torch.randint(0, args.vocab_size, (2, 17))
    mask = (torch.rand(2, 16) < 0.7).double()
    upstream = torch.randn(2, 16, dtype=torch.float64)
    results = {}
    for chunk, m in ((5, None), (1000, mask)):
        ref.zero_grad()
        model.zero_grad()
        lp_ref, ent_ref = ref.logprobs(tokens[:, :-1], tokens[:, 1:], chunk, with_entropy=True, mask_BT=m)
        (lp_ref * upstream).sum().backward()
        with _VocabSizedOutputs(args.vocab_size) as detector:
            lp, ent = model.logprobs(tokens[:, :-1], tokens[:, 1:], chunk, with_entropy=True, mask_BT=m)
            (lp * upstream).sum().backward()
        assert not detector.hits, detector.hits
        grads = dict(ref.named_parameters())
        grad_err = max((_full(p.grad) - grads[n].grad).abs().max().item() for n, p in model.named_parameters())
        results[f"chunk{chunk}/{'masked' if m is not None else 'all'}"] = {
            "logprobs": (lp - lp_ref).abs().max().item(),
            "entropy": (ent - ent_ref).abs().max().item(),
            "grads": grad_err,
        }
    # The detector does see gathered logits (the path this replaced).
    with _VocabSizedOutputs(args.vocab_size) as detector:
        del model.output.forward
        model(tokens)
    results["detector_sees_gathered_logits"] = bool(detector.hits)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    rank, world_size = init_distributed()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    results = {}
    for V, B, T, chunk, h_layout in CASES:
        for masked in (False, True):
            key = f"V{V}/chunk{chunk}/{h_layout}/{'masked' if masked else 'all'}"
            results[key] = function_errors(mesh, V, B, T, chunk, h_layout, masked)
    results["V194/chunk5/float32"] = function_errors(mesh, 194, 3, 11, 5, "seq_sharded", True, torch.float32)
    results["empty_mask_ok"] = empty_mask_ok(mesh)
    for family in ("qwen3", "qwen2"):
        results[f"model/{family}"] = model_errors(mesh, family)
    if rank == 0:
        with open(cli.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
