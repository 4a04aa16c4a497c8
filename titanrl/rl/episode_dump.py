"""A few sampled episodes per logged RL step, as JSON lines for the rollout viewer (`titanrl show`).

Every `metrics.log_freq` steps rank 0 appends `metrics.dump_episodes` of the step's generated
samples to <dump_folder>/episodes.jsonl, one row each (`titanrl/components/viewer.py` reads them):

    step, index (0.. within the step), sample (its position in this rank's rollouts), prompt,
    token_ids, pieces (each token's text), special_tokens ({id: 'eos' | 'bos' | 'pad'} of those
    among them), model_mask (1 sampled by the model, 0 environment), logprobs (the generator's;
    0 for environment tokens), entropies (None: the generator does not compute them), turns
    ([{role: 'model' | 'env', start, end, text, tool_calls}]), reward (the total the step trains
    on), verifier_reward, correct, failed, turn_rewards, finish_reason.

Everything it reads is already on the host (token ids, masks and logprobs are Python lists), so
the dump adds no device synchronisation; its cost is decoding a few samples' tokens.
"""

from __future__ import annotations

import json
import os

from titanrl.components.viewer import EPISODES_FILE
from titanrl.envs.multi_turn import ToolSetup, decode_turn, special_token_ids
from titanrl.envs.tool_calls import ToolCallError, parse_tool_calls, tool_name
from titanrl.generator import Completion
from titanrl.models.tokenizer import Tokenizer
from titanrl.rl.groups import Rollouts

_REPLACEMENT = "\ufffd"
_PIECE_WINDOW = 4  # tokens decoded before each one: enough to finish a split multi-byte character


def token_pieces(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds to the decoding of `ids`: a token that only starts a multi-byte
    character adds '' and the one that completes it adds the character, so that the pieces join
    to the decoded text; a special token (which decodes to no text) adds ''."""
    pieces = []
    for i in range(len(ids)):
        start = max(0, i - _PIECE_WINDOW)
        before = tokenizer.decode(ids[start:i]).rstrip(_REPLACEMENT)
        text = tokenizer.decode(ids[start : i + 1])
        if i + 1 < len(ids):
            text = text.rstrip(_REPLACEMENT)
        pieces.append(text[len(before) :] if text.startswith(before) else tokenizer.decode([ids[i]]))
    return pieces


def mask_runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, value) of each run of equal values of `mask`."""
    runs: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if runs and runs[-1][2] == m:
            runs[-1] = (runs[-1][0], i + 1, m)
        else:
            runs.append((i, i + 1, m))
    return runs


class EpisodeDump:
    """Appends a few of each logged step's episodes to <folder>/episodes.jsonl (rank 0 only)."""

    def __init__(
        self,
        folder: str,
        rank: int,
        num_episodes: int,
        log_freq: int,
        tokenizer: Tokenizer,
        tools: ToolSetup | None = None,
        append: bool = False,
    ) -> None:
        """`tools`: how an environment's turns are read (None: single-turn or no tools);
        `append` continues the file of a resumed run instead of starting it anew."""
        self.path = os.path.join(folder, EPISODES_FILE)
        self.enabled = rank == 0 and num_episodes > 0
        self.num_episodes, self.log_freq = num_episodes, log_freq
        self.tokenizer, self.tools = tokenizer, tools
        self.keep = special_token_ids(tokenizer, tools.keep_tokens) if tools is not None else {}
        self.tool_names = [tool_name(t) for t in tools.tools] if tools is not None and tools.tools else None
        if self.enabled and not append and os.path.exists(self.path):
            os.remove(self.path)  # a fresh run in a used folder starts its own file, as metrics.jsonl does

    def chosen(self, n: int) -> list[int]:
        """Which of `n` samples to dump: evenly spaced, so that several prompt groups are seen."""
        k = min(self.num_episodes, n)
        return [i * n // k for i in range(k)] if k else []

    def write(self, rollouts: Rollouts, step: int, group_size: int) -> None:
        """Append the chosen episodes of `rollouts` if `step` is a logged one."""
        if not self.enabled or step % self.log_freq:
            return
        rows = []
        for index, i in enumerate(self.chosen(len(rollouts.completions))):
            prompt_ids = rollouts.prompts[i // group_size]
            rows.append({"step": step, "index": index, "sample": i, **self.episode(rollouts, i, prompt_ids)})
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)

    def episode(self, rollouts: Rollouts, i: int, prompt_ids: list[int]) -> dict:
        c, result = rollouts.completions[i], rollouts.results[i]
        mask = list(c.model_mask) if c.model_mask is not None else [1] * len(c.token_ids)
        pieces = token_pieces(self.tokenizer, c.token_ids)
        return {
            "prompt": self.tokenizer.decode(prompt_ids),
            "prompt_tokens": len(prompt_ids),
            "token_ids": list(c.token_ids),
            "pieces": pieces,
            "special_tokens": self.special_names(c.token_ids, pieces),
            "model_mask": mask,
            "logprobs": [float(x) for x in c.logprobs],
            "entropies": None,
            "turns": self.turns(c, mask),
            "reward": float(rollouts.rewards[i]),
            "verifier_reward": float(result.reward),
            "correct": bool(result.correct),
            "failed": result.failed,
            "turn_rewards": result.turn_rewards,
            "finish_reason": c.finish_reason,
        }

    def special_names(self, ids: list[int], pieces: list[str]) -> dict[str, str]:
        """{id: 'eos' | 'bos' | 'pad'} of the tokenizer's named special tokens among the sample's
        tokens that add no text (JSON keys are strings)."""
        tok = self.tokenizer
        names = {tok.pad_id: "pad", tok.eos_id: "eos"}  # eos wins where the pad token is the eos
        if tok.bos_id is not None:
            names[tok.bos_id] = "bos"
        return {str(i): names[i] for i, piece in zip(ids, pieces) if not piece and i in names}

    def turns(self, c: Completion, mask: list[int]) -> list[dict]:
        """The model's turns and the environment's observations, each with its token span; a
        model turn of a tool environment with the tool calls read from its text."""
        out = []
        for start, end, model in mask_runs(mask):
            ids = c.token_ids[start:end]
            text = decode_turn(self.tokenizer, ids, self.keep) if model else self.tokenizer.decode(ids)
            turn = {"role": "model" if model else "env", "start": start, "end": end, "text": text}
            if model and self.tools is not None:
                turn.update(self.tool_calls(text))
            out.append(turn)
        return out

    def tool_calls(self, text: str) -> dict:
        """{'tool_calls': [{name, arguments, text}]} of a model turn, or {'tool_error': why}."""
        assert self.tools is not None
        try:
            calls = parse_tool_calls(text, self.tools.tool_format, self.tool_names)
        except ToolCallError as e:
            return {"tool_calls": [], "tool_error": str(e)}
        return {"tool_calls": [{"name": t.name, "arguments": t.arguments, "text": t.text} for t in calls]}
