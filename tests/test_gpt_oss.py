"""gpt-oss against transformers' `GptOssForCausalLM` on tiny random checkpoints (float32, norm
weights and every bias randomised, weights of std 0.02 and 0.2, sliding window 8 with prompts
longer than it): logits, export -> reload, a bit-exact round trip, YaRN, the paged backends with
sinks and windows against a float64 reference, greedy generations and logprobs through the paged
generator (prefix-cache hits included), one step's gradients against float64, the flavors'
published parameter counts, harmony, packed rows, routing replay and 2-rank ep / tp training.
Each checkpoint, its titanrl model and its paged-generator run are built once for the module."""

import json
import math
import os

import pytest
import torch
from helpers import background
from helpers.launch import REPO_ROOT

transformers = pytest.importorskip("transformers")

from titanrl.config.generation import Generator as GeneratorConfig  # noqa: E402
from titanrl.generator import Generator, SamplingParams  # noqa: E402
from titanrl.generator.paged_attention import PagedBatch, SeqSlice, paged_attention  # noqa: E402
from titanrl.models import Transformer, get_model_args  # noqa: E402
from titanrl.models.args import YarnRope  # noqa: E402
from titanrl.models.attention import DocumentFlexAttention, DocumentSDPA  # noqa: E402
from titanrl.models.hf import (  # noqa: E402
    export_hf,
    from_hf_state_dict,
    load_hf_weights,
    load_safetensors_folder,
    read_hf_config,
    to_hf_state_dict,
)
from titanrl.models.yarn import yarn_inv_freq  # noqa: E402

TOL = 1e-5
VOCAB, WINDOW = 300, 8
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}


def _tiny_hf(std: float):
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        rope_parameters=dict(YARN),
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "sinks" in name or "router" in name:
                p.copy_(torch.randn_like(p))  # sinks that matter; decisive routing
            else:
                p.copy_(std * torch.randn_like(p))  # weights and biases alike
    return model.eval()


@pytest.fixture(scope="module", params=[0.02, 0.2], ids=["std0.02", "std0.2"])
def hf_folder(request, tmp_path_factory):
    model = _tiny_hf(request.param)
    folder = tmp_path_factory.mktemp(f"gpt_oss_{request.param}")
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def titan(hf_folder) -> Transformer:
    """titanrl's float32 model loaded from the checkpoint (read-only in the tests)."""
    return _titan(hf_folder[1])


def _titan(folder, dtype=torch.float32) -> Transformer:
    with torch.device("meta"):
        model = Transformer(read_hf_config(str(folder)))
    model.to_empty(device="cpu")
    model.init_weights()
    load_hf_weights(model, str(folder))
    return model.to(dtype).eval()


def _tokens(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def test_logits_export_and_bit_exact_round_trip(hf_folder, titan, tmp_path):
    (hf_model, folder), model = hf_folder, titan
    assert [b.attention.window for b in model.blocks()] == [WINDOW, 0, WINDOW, 0]
    tokens_BT = _tokens(3, 3 * WINDOW + 5)
    with torch.no_grad():
        ref = hf_model(input_ids=tokens_BT).logits
        assert (model(tokens_BT) - ref).abs().max().item() < TOL
    export_hf(model, str(tmp_path / "export"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (reloaded(input_ids=tokens_BT).logits - ref).abs().max().item() < TOL
    hf_sd = load_safetensors_folder(str(folder))
    assert set(load_safetensors_folder(str(tmp_path / "export"))) == set(hf_sd)
    back = to_hf_state_dict(from_hf_state_dict(hf_sd, model.args), model.args)
    assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_matches_transformers(truncate):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.GptOssConfig(
        head_dim=64, max_position_embeddings=131072, rope_parameters={**YARN, "truncate": truncate}
    )
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    yarn = YarnRope(factor=32.0, original_max_position_embeddings=64, truncate=truncate)
    inv_freq, factor = yarn_inv_freq(64, 150000.0, yarn)
    assert torch.equal(inv_freq, ref_inv_freq) and factor == ref_factor


def _reference_attention(q_NHD, k_pages, v_pages, tables, positions, sinks_H, window):
    """float64: each query's softmax over its sequence's last `window` keys and its head's sink."""
    B, (H, D), Hkv = k_pages.shape[1], q_NHD.shape[1:], k_pages.shape[2]
    out, n = [], 0
    for table, pos in zip(tables, positions):
        for p in pos:
            keys = [k for k in range(p + 1) if not window or k > p - window]
            slots = [table[k // B] * B + k % B for k in keys]
            k_LHD = k_pages.view(-1, Hkv, D)[slots].double().repeat_interleave(H // Hkv, 1)
            v_LHD = v_pages.view(-1, Hkv, D)[slots].double().repeat_interleave(H // Hkv, 1)
            s_HL = torch.einsum("hd,lhd->hl", q_NHD[n].double(), k_LHD) / math.sqrt(D)
            p_HL = torch.softmax(torch.cat([s_HL, sinks_H.double()[:, None]], 1), 1)[:, :-1]
            out.append(torch.einsum("hl,lhd->hd", p_HL, v_LHD))
            n += 1
    return torch.stack(out)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("kind", ["flex", "gathered", "exact"])
def test_paged_backends_with_sinks_and_window_match_float64(kind, window):
    B, P, Hkv, H, D = 4, 16, 2, 6, 8
    seqs = [
        SeqSlice([3, 7, 1, 9], 4 * B - 1, 2 * B + 1),
        SeqSlice([3, 7, 12], 2 * B + 2, 2),
        SeqSlice([5, 8], B + 1, 1),
    ]
    g = torch.Generator().manual_seed(0)
    k_pages, v_pages = torch.randn(P, B, Hkv, D, generator=g), torch.randn(P, B, Hkv, D, generator=g)
    N = sum(s.num_new for s in seqs)
    q, k, v = (torch.randn(1, N, h, D, generator=g) for h in (H, Hkv, Hkv))
    sinks_H = 2 * torch.randn(H, generator=g)
    batch = PagedBatch.from_slices(seqs, P - 1, B, torch.device("cpu"), num_pages=P if kind == "flex" else None)
    out = paged_attention(kind, batch, [k_pages], [v_pages]).attend(0, q, k, v, sinks_H=sinks_H, window=window)
    positions = [list(range(s.context_len - s.num_new, s.context_len)) for s in seqs]
    ref = _reference_attention(q[0], k_pages, v_pages, [s.block_table for s in seqs], positions, sinks_H, window)
    torch.testing.assert_close(out[0].double(), ref, atol=1e-5, rtol=1e-5)


PROMPT_LENGTHS = (1, 3, 5, 8, 9, 13, 17, 21, 30, 4, 11, 25)  # most longer than the window
NEW_TOKENS, REPEAT_TOKENS = 8, 3


@pytest.fixture(scope="module")
def paged_run(hf_folder):
    """The paged generator on 12 prompts, greedy, then on the same prompts again for a few tokens
    (prefix-cache hits: a prefill over cached pages, then decoding): FlexAttention / gathered on
    std 0.02, the exact backend on std 0.2 (its batch-invariant matmuls make each decode step
    costly on a CPU, hence the short second pass)."""
    hf_model, folder = hf_folder
    attention_impl = "exact" if _std(hf_model) > 0.1 else "auto"
    args = read_hf_config(str(folder))
    gen = Generator(
        args, GeneratorConfig(block_size=4, num_blocks=256, attention_impl=attention_impl), torch.device("cpu")
    )
    gen.load_hf(str(folder))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    completions, _ = gen.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0))
    again, stats = gen.generate(prompts, SamplingParams(max_new_tokens=REPEAT_TOKENS, temperature=0))
    return prompts, completions, again, stats


def _std(hf_model) -> float:
    return hf_model.model.layers[0].mlp.experts.down_proj.std().item()


def test_paged_generator_matches_transformers_generate(hf_folder, paged_run):
    """Greedy tokens equal transformers' (each token the argmax of its logits given the prompt
    and the tokens before it; `generate` itself on the longest prompt), logprobs within 1e-4 of
    its log-softmax; the same for the first tokens again on prefix-cache hits."""
    hf_model, _ = hf_folder
    prompts, completions, again, stats = paged_run
    assert stats.prefix_cache_hit_tokens > 0
    # One right-padded forward over every prompt + completion (causal: padding after a token
    # does not change its logits) stands for 12 `generate` calls of NEW_TOKENS steps each.
    fed = [p + c.token_ids[:-1] for p, c in zip(prompts, completions, strict=True)]
    tokens_BT = torch.zeros(len(fed), max(map(len, fed)), dtype=torch.long)
    for row, ids in zip(tokens_BT, fed):
        row[: len(ids)] = torch.tensor(ids)
    with torch.no_grad():
        logprobs_BTV = torch.log_softmax(hf_model(input_ids=tokens_BT).logits, -1)
    for b, (prompt, completion, repeat) in enumerate(zip(prompts, completions, again, strict=True)):
        ref_LV = logprobs_BTV[b, len(prompt) - 1 : len(fed[b])]
        assert len(completion.token_ids) == NEW_TOKENS
        assert completion.token_ids == ref_LV.argmax(-1).tolist()
        assert repeat.token_ids == completion.token_ids[:REPEAT_TOKENS]
        ref_logprobs = ref_LV.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        assert (torch.tensor(completion.logprobs, dtype=torch.float64) - ref_logprobs).abs().max() < 1e-4
        assert (torch.tensor(repeat.logprobs, dtype=torch.float64) - ref_logprobs[:REPEAT_TOKENS]).abs().max() < 1e-4
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = hf_model.generate(
        torch.tensor([prompts[longest]]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert out[0, len(prompts[longest]) :].tolist() == completions[longest].token_ids


def test_one_step_gradients_match_float64(hf_folder):
    """Within 1e-6 (relative to max(1, |grad|)) at std 0.02; at std 0.2 float32 round-off grows
    through the layers to ~7e-6 at the embedding, so the bound there is 2e-5."""
    hf_model, folder = hf_folder
    tol = 2e-5 if _std(hf_model) > 0.1 else 1e-6
    tokens_BT = _tokens(2, 2 * WINDOW + 3, seed=2)
    grads = {}
    for dtype in (torch.float32, torch.float64):
        model = _titan(folder, dtype).train()
        logprobs_BT, _ = model.logprobs(tokens_BT[:, :-1], tokens_BT[:, 1:], chunk_tokens=16)
        (-logprobs_BT.mean() + 0.01 * model.moe_aux_loss()).backward()
        grads[dtype] = {n: p.grad for n, p in model.named_parameters()}
    assert grads[torch.float32].keys() == grads[torch.float64].keys()
    worst = {}
    for name, grad in grads[torch.float32].items():
        ref = grads[torch.float64][name]
        assert ref.abs().max() > 0, name
        worst[name] = ((grad.double() - ref).abs().max() / max(1.0, ref.abs().max().item())).item()
    assert max(worst.values()) < tol, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


def _total_and_active(model: Transformer) -> tuple[float, float]:
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    return total, total - routed + routed * model.args.moe_top_k / model.args.moe_num_experts


@pytest.mark.parametrize("flavor,total_b,active_b", [("gpt-oss-20b", 20.91, 3.61), ("gpt-oss-120b", 116.83, 5.13)])
def test_flavors_have_the_published_parameter_counts(flavor, total_b, active_b):
    """OpenAI's model card counts the embedding once (the unembedding counts as active)."""
    with torch.device("meta"):
        model = Transformer(get_model_args(flavor))
    total, active = _total_and_active(model)
    embedding = model.tok_embeddings.weight.numel()
    assert round(total / 1e9, 2) == total_b
    assert round((active - embedding) / 1e9, 2) == active_b


@pytest.mark.parametrize("backend_cls", [DocumentSDPA, DocumentFlexAttention])
def test_packed_rows_match_each_document_alone(hf_folder, titan, backend_cls):
    """The trainer's packed backends: two documents in one row (positions restarting) give each
    document's logits as it gets alone, sinks and windows included (std 0.2 only, for run time;
    FlexAttention's exp2 softmax rounds a little differently: 5e-5 there)."""
    hf_model, _ = hf_folder
    if _std(hf_model) < 0.1:
        pytest.skip("run on the std 0.2 checkpoint only")
    model = titan
    a, b = _tokens(1, 2 * WINDOW + 3, seed=3), _tokens(1, WINDOW + 5, seed=4)
    doc_1S = torch.tensor([[0] * a.shape[1] + [1] * b.shape[1]])
    positions_1S = torch.cat([torch.arange(a.shape[1]), torch.arange(b.shape[1])])[None]
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), positions_1S, backend_cls(doc_1S))
        alone = torch.cat([model(a), model(b)], 1)
    assert (packed - alone).abs().max().item() < (5e-5 if backend_cls is DocumentFlexAttention else TOL)


# The harmony format of gpt-oss's chat_template.jinja, condensed: system header, developer
# instructions, the last assistant turn's reasoning on the analysis channel (earlier turns keep
# their final answer only), `<|return|>` closing the last turn, `<|start|>assistant` as the
# generation prompt.
HARMONY = (
    '{%- set reasoning_effort = reasoning_effort | default("medium") -%}'
    '{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n'
    'Reasoning: " + reasoning_effort + "\\n\\n# Valid channels: analysis, commentary, final.<|end|>" -}}'
    '{%- if messages and messages[0].role in ("system", "developer") -%}'
    '{{- "<|start|>developer<|message|># Instructions\\n\\n" + messages[0].content + "<|end|>" -}}'
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    '{%- if message.role == "user" -%}{{- "<|start|>user<|message|>" + message.content + "<|end|>" -}}'
    '{%- elif message.role == "assistant" -%}'
    "{%- if message.thinking and loop.last -%}"
    '{{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" -}}{%- endif -%}'
    '{{- "<|start|>assistant<|channel|>final<|message|>" + message.content -}}'
    '{{- "<|return|>" if loop.last else "<|end|>" -}}'
    "{%- endif -%}{%- endfor -%}"
    '{%- if add_generation_prompt -%}{{- "<|start|>assistant" -}}{%- endif -%}'
)
HARMONY_SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>"]
HARMONY_SPECIAL += ["<|return|>", "<|call|>", "<|constrain|>"]


@pytest.fixture(scope="module")
def harmony_folder(tmp_path_factory):
    """A BPE tokenizer with harmony's special tokens, and the template in chat_template.jinja."""
    pytest.importorskip("jinja2")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=HARMONY_SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["What is 6 times 7? The answer is 42.", "We need to multiply six by seven.", "analysis final"]
    tok.train_from_iterator(corpus * 20, trainer=trainer)
    folder = tmp_path_factory.mktemp("harmony")
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(HARMONY)
    return str(folder)


def test_harmony_chat_template_renders_as_transformers_and_masks_the_reasoning(harmony_folder):
    from titanrl.models.chat_template import load_chat_template
    from titanrl.models.tokenizer import HFTokenizer

    template, tok = load_chat_template(harmony_folder), HFTokenizer(harmony_folder)
    hf_tok = transformers.AutoTokenizer.from_pretrained(harmony_folder)
    prompt = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "What is 6 times 7?"}]
    for kwargs in ({}, {"reasoning_effort": "high"}):
        ref = hf_tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs)
        assert template.encode(tok, prompt, add_generation_prompt=True, **kwargs) == ref["input_ids"]
    assert all(len(tok.encode(s)) == 1 for s in HARMONY_SPECIAL)  # each special token is one id

    answer = {"role": "assistant", "thinking": "We need to multiply six by seven.", "content": "42"}
    ids, mask = template.assistant_mask(tok, [*prompt, answer])
    text, spans = template.assistant_spans([*prompt, answer])
    # The whole turn the model writes after `<|start|>assistant`: reasoning channel, then final.
    assert [text[a:b] for a, b in spans] == [
        "<|channel|>analysis<|message|>We need to multiply six by seven.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>42<|return|>"
    ]
    assert [ids[a:b] for a, b in _runs(mask)] == [tok.encode(text[a:b]) for a, b in spans]
    # An earlier turn loses its reasoning when a later one follows: the prefix mask says so.
    with pytest.raises(ValueError, match="does not render prefixes consistently at message 2"):
        template.assistant_mask(tok, [*prompt, answer, {"role": "user", "content": "Half?"}, answer])


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[(start, end)] of the maximal runs of 1s."""
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


background.register_torchrun(
    "gpt_oss_parallel",
    ("tests/test_gpt_oss.py::test_ep2_and_tp2_training_steps_match_one_rank",),
    os.path.join(REPO_ROOT, "tests", "multirank", "gpt_oss_parity_worker.py"),
    2,
    lambda folder: ["--out", f"{folder}/results.pt"],
)  # in the background from collection on (helpers/background.py)


@pytest.mark.multirank
def test_ep2_and_tp2_training_steps_match_one_rank():
    """2 float64 steps of a tiny gpt-oss under ep = 2 and tp = 2 (2 gloo ranks, one launch)
    equal 1 rank: losses, last gradients and parameters (sinks sharded with their heads under
    tp)."""
    import sys

    sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "multirank"))
    import gpt_oss_parity_worker as worker

    launched = torch.load(os.path.join(background.torchrun_result("gpt_oss_parallel"), "results.pt"))
    ref = worker.run_layout(None, world_size=1)
    assert ref["losses"][1] < ref["losses"][0]
    assert ref["params"]["layers.0.attention.sinks"].shape == (worker.GPT_OSS_ARGS.n_heads,)
    for layout in worker.GPT_OSS_LAYOUTS:
        got = launched[layout]
        assert got["losses"] == pytest.approx(ref["losses"], abs=1e-10)
        for kind in ("grads", "params"):
            assert got[kind].keys() == ref[kind].keys()
            assert max((got[kind][k] - ref[kind][k]).abs().max().item() for k in ref[kind]) < 1e-10, (layout, kind)


def test_generator_records_the_routes_the_trainer_replays(hf_folder, titan, paged_run):
    """The generator records each layer's experts per fed token (routing replay): the trainer's
    router picks the same ones, and replaying them gives the same logits (the exact backend's
    run: a prompt shorter than the window and one of nearly four windows)."""
    hf_model, folder = hf_folder
    if _std(hf_model) < 0.1:
        pytest.skip("run on the std 0.2 checkpoint only")
    args, model = read_hf_config(str(folder)), titan
    prompts, completions, _, _ = paged_run
    for i in (PROMPT_LENGTHS.index(5), PROMPT_LENGTHS.index(30)):
        fed_1T = torch.tensor([prompts[i] + completions[i].token_ids[:-1]])
        routes = completions[i].routes
        assert routes is not None and routes.shape == (fed_1T.shape[1], args.n_layers, args.moe_top_k)
        with torch.no_grad():
            logits = model(fed_1T)
            routes_LTK = routes.long().transpose(0, 1)
            assert torch.equal(model.moe_routes().sort(-1).values, routes_LTK.sort(-1).values)
            assert (model(fed_1T, routes_LTK=routes_LTK) - logits).abs().max().item() < TOL
