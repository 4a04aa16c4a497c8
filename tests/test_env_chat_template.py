"""Multi-turn environments with a chat template: episodes driven through the paged generator by a
scripted model at the real Qwen2.5 vocabulary and ChatML template are the template's rendering of
the conversation (observations as 'user' or 'tool' messages), the end-of-turn text after a turn
that ended on max tokens, not repeated after one that ended on eos; only the model's tokens are
in the loss mask. Without a template, observations stay raw tokens."""

import pytest
import torch

pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")

from helpers.real_vocab import write_qwen_layout_folder  # noqa: E402
from test_envs import ScriptedModel  # noqa: E402

from titanrl.config.generation import Generator as GeneratorConfig  # noqa: E402
from titanrl.config.rewards_envs import Env  # noqa: E402
from titanrl.data.batch import build_sequence_batch  # noqa: E402
from titanrl.data.encode import PromptEncoder  # noqa: E402
from titanrl.envs.multi_turn import ChatTurns, MultiTurnRollout  # noqa: E402
from titanrl.envs.pool import EnvPool  # noqa: E402
from titanrl.generator import Generator, SamplingParams  # noqa: E402
from titanrl.models import TransformerModelArgs  # noqa: E402
from titanrl.models.chat_template import ChatTemplate  # noqa: E402
from titanrl.models.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402

ARGS = TransformerModelArgs(
    family="qwen3",
    dim=16,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    hidden_dim=32,
    vocab_size=151936,
    qk_norm=True,
    max_seq_len=512,
)
PROMPT = "What is 6 times 7?"
OBSERVATION = "<result>ok</result>"  # tests/helpers/env_fns.py's EchoEnv, at every step but the last
# Turn 1 ends on max tokens (its token count is max_new_tokens), turns 2 and 3 on eos (<|im_end|>).
TURNS = ["Let's think step by step: 6 times 7", "The answer is 42.", "The answer is 42"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen")
    write_qwen_layout_folder(path)
    return str(path)


def _conversation(encoder: PromptEncoder, role: str) -> list[dict]:
    """The episode as messages: prompt, then assistant turns and observations alternating."""
    messages = encoder.messages(PROMPT)
    for k, text in enumerate(TURNS):
        if k:
            messages.append({"role": role, "content": OBSERVATION})
        messages.append({"role": "assistant", "content": text})
    return messages


def _run_episode(folder: str, role: str, system_prompt: str):
    """(prompt ids, the completion, the conversation's ids as the template renders them) of one
    EchoEnv(turns=3) episode whose model is scripted to follow the rendered conversation."""
    tok = HFTokenizer(folder)
    encoder = PromptEncoder(tok, ChatTemplate.from_folder(folder), system_prompt)
    expected = encoder.template.encode(tok, _conversation(encoder, role))
    gen = Generator(ARGS, GeneratorConfig(block_size=4, num_blocks=256), torch.device("cpu"), tokenizer=tok)
    gen.model = ScriptedModel(expected, ARGS.vocab_size)
    pool = EnvPool("helpers.env_fns:EchoEnv", {"turns": 3}, num_workers=1)
    try:
        rollout = MultiTurnRollout(
            pool,
            tok,
            max_turns=4,
            max_total_tokens=400,
            failure_reward=-1.0,
            prompt_encoder=encoder,
            observation_role=role,
        )
        (prompt,) = rollout.start([{"prompt": PROMPT, "answer": "", "metadata": {}}], 1)
        gen.wake()
        params = SamplingParams(max_new_tokens=len(tok.encode(TURNS[0])), temperature=0.0)
        (completion,), _ = gen.generate([prompt], params, turns=rollout)
    finally:
        pool.close()
    assert rollout.episodes[(0, 0)].turns == 3 and rollout.episodes[(0, 0)].failed is None
    return tok, prompt, completion, expected


@pytest.mark.parametrize("role,system_prompt", [("user", ""), ("tool", "Be brief.")])
def test_episode_is_the_templates_conversation_and_only_the_model_is_trained(folder, role, system_prompt):
    tok, prompt, c, expected = _run_episode(folder, role, system_prompt)
    # The episode is the template's rendering of the whole conversation, up to the newline
    # ChatML writes after the last turn's <|im_end|> (the episode ends on that eos).
    assert prompt + c.token_ids + tok.encode("\n") == expected
    assert c.finish_reason == "stop"
    # Turn by turn, in ChatML: after the max-tokens turn the whole end-of-turn text is appended,
    # after an eos turn all but the model's own <|im_end|>; the observation as a `role` message.
    eos = tok.encode("<|im_end|>")
    assert eos == [tok.eos_id]
    message = OBSERVATION if role == "user" else f"<tool_response>\n{OBSERVATION}\n</tool_response>"
    between = f"\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
    a1, a2, a3 = (tok.encode(t) for t in TURNS)
    d1, d2 = tok.encode("<|im_end|>" + between), tok.encode(between)
    assert c.token_ids == a1 + d1 + a2 + eos + d2 + a3 + eos
    model_mask = [1] * len(a1) + [0] * len(d1) + [1] * (len(a2) + 1) + [0] * len(d2) + [1] * (len(a3) + 1)
    assert c.model_mask == model_mask
    # The loss mask of the training batch, target by target: only the model's tokens (its eos too).
    batch = build_sequence_batch([prompt], [c.token_ids], tok.pad_id, [c.logprobs], [c.model_mask])
    loss_mask = batch["loss_mask"][0].tolist()
    assert loss_mask == [0] * (len(prompt) - 1) + model_mask
    assert all(lp == 0.0 for lp, m in zip(c.logprobs, model_mask) if not m)
    # ... a subset of what the template itself calls the assistant's (which adds the "\n" after
    # each <|im_end|>, and the <|im_end|> of the max-tokens turn that the model did not write).
    template = ChatTemplate.from_folder(folder)
    ids, assistant = template.assistant_mask(tok, _conversation(PromptEncoder(tok, template, system_prompt), role))
    assert ids == expected
    ours = [0] * len(prompt) + model_mask
    assert all(a >= o for a, o in zip(assistant, ours))
    assert [
        tok.decode([t]) if t != tok.eos_id else "<|im_end|>"
        for t, a, o in zip(ids, assistant, ours + [0])
        if a and not o
    ] == ["<|im_end|>", "\n", "\n", "\n"]


def test_conversation_matches_transformers_apply_chat_template(folder):
    """The reference the episodes are compared with is transformers' rendering."""
    transformers = pytest.importorskip("transformers")
    tok, hf = HFTokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    for role in ("user", "tool"):
        encoder = PromptEncoder(tok, ChatTemplate.from_folder(folder))
        messages = _conversation(encoder, role)
        ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert encoder.template.encode(tok, messages) == list(ids)


def test_templates_that_rewrite_earlier_turns_are_rejected():
    counting = ChatTemplate(
        "{{ messages | length }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}",
        source="counting",
    )
    chat = ChatTurns(PromptEncoder(ByteTokenizer(), counting), "user")
    chat.start([(0, 0)], "hi")
    with pytest.raises(ValueError, match="counting does not render the conversation consistently"):
        chat.observation((0, 0), "obs", None)
    with pytest.raises(ValueError, match="observation role must be one of"):
        ChatTurns(PromptEncoder(ByteTokenizer(), counting), "system")


def test_observation_role_config():
    Env(observation_role="tool").validate()
    with pytest.raises(ValueError, match=r"\[env\] observation_role must be 'user' or 'tool', got 'system'"):
        Env(observation_role="system").validate()


def test_without_a_template_observations_stay_raw_tokens():
    """The recipe's wiring (a PromptEncoder without a template, no encode_prompt) gives the raw
    observation tokens of tests/test_envs.py's calculator episode."""
    from test_envs import ARGS as BYTE_ARGS

    tok = ByteTokenizer()
    prompt = "4 boxes of 37 pens. pens? "
    call, result, answer = tok.encode("<tool>4*37</tool>"), tok.encode("<result>148</result>"), tok.encode("148")
    script = [tok.bos_id, *tok.encode(prompt)] + call + result + answer + [tok.eos_id]
    gen = Generator(BYTE_ARGS, GeneratorConfig(block_size=4, num_blocks=128), torch.device("cpu"), tokenizer=tok)
    gen.model = ScriptedModel(script, BYTE_ARGS.vocab_size)
    pool = EnvPool("calculator", num_workers=1)
    try:
        rollout = MultiTurnRollout(pool, tok, 4, 250, -1.0, prompt_encoder=PromptEncoder(tok), observation_role="tool")
        prompts = rollout.start([{"prompt": prompt, "answer": "148", "metadata": {}}], 1)
        gen.wake()
        (c,), _ = gen.generate(
            prompts, SamplingParams(max_new_tokens=32, temperature=0.0, stop_strings=["</tool>"]), turns=rollout
        )
    finally:
        pool.close()
    assert prompts == [[tok.bos_id, *tok.encode(prompt)]]
    assert c.token_ids == call + result + answer + [tok.eos_id]
    assert c.model_mask == [1] * len(call) + [0] * len(result) + [1] * (len(answer) + 1)
