"""Agent episodes through the OpenAI-compatible endpoint (`[agent] function`, a raw `openai` loop) vs
the same episodes as an in-process environment, one rank, in one run: episodes/s and the
generator's idle fraction.

    python -m benchmarks.bench_agent_endpoint --out benchmarks/bench_agent_endpoint.json
    python -m benchmarks.bench_agent_endpoint --quick     # a smoke run (tests/test_bench_agent.py)

`prompts * group_size` episodes (256 by default) in flight at once on the paged generator, each
one tool call: the model's first turn calls `add` (Hermes `<tool_call>` JSON), the tool's result
comes back as a 'tool' message, the model's second turn answers (reward 1 if it has the sum).
Both sides render the conversation with the same ChatML template and tools at byte tokens, so
their samples are the same tokens:
  endpoint    AgentPool + AgentRollout: `agent` (benchmarks/agent_endpoint_fns.py), a raw `openai` client loop in
              `--workers` agent worker processes, every model call an HTTP request to the
              rank's endpoint (titanrl/envs/agent_pool.py); each episode's AsyncOpenAI client
              on the worker's one httpx connection pool
  endpoint_own_client  the same, each episode's client with a connection pool of its own (as
              `AsyncOpenAI(base_url=..., api_key=...)` alone makes it: an SSL context each)
  in_process  EnvPool + MultiTurnRollout: `AddEnv` (the same file), a ToolEnv-style environment doing the same
              tool in `--workers` environment worker processes (titanrl/envs/pool.py)
The model is tiny (`--dim`, 2 layers, random weights) with a position-indexed logit bias that
writes its turns (the call, then a short answer): the generator does real decode steps while
its output is fixed, so the harnesses' own cost shows. Generator idle time is measured from the
generator's step loop: the scheduler calls the turn handler's `poll(block=True)` only when it
has no sequence to prefill or decode (titanrl/generator/scheduler.py), and those calls are
timed; the wait for the episodes' first calls (`start`, before the generator has anything to
run) is idle too.
idle fraction = (start + blocked polls) / rollout seconds (start + generate + finish). Median
of `--repeats` alternating runs after a small warm-up run of each.
"""

import argparse
import statistics
import time

import torch
from torch import nn

from benchmarks.agent_endpoint_fns import ADD, ANSWER, CALL
from benchmarks.harness import episode_report
from titanrl.config.agent import Agent
from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.data.encode import PromptEncoder
from titanrl.envs.agent_pool import AgentPool
from titanrl.envs.agent_rollout import AgentRollout
from titanrl.envs.multi_turn import MultiTurnRollout
from titanrl.envs.openai_endpoint import Served
from titanrl.envs.pool import EnvPool
from titanrl.generator import Generator, SamplingParams
from titanrl.models import TransformerModelArgs
from titanrl.models.chat_template import ChatTemplate
from titanrl.models.tokenizer import ByteTokenizer

DOC_TABLES = [
    ("Episodes/s and generator idle fraction (median)", ["summary"], None),
    ("Ratios", ["ratios"], None),
]
ENV_SPEC = "benchmarks.agent_endpoint_fns:AddEnv"
AGENT_SPEC = "benchmarks.agent_endpoint_fns:agent"
# ChatML with a Hermes tools section, as Qwen2.5's template writes it (shortened).
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class ScriptedTiny(nn.Module):
    """A tiny transformer whose logits get `bias_PV[position]`: a fed token at position p is
    followed by the forced token of position p + 1, if any, and never by eos otherwise."""

    def __init__(self, inner: nn.Module, bias_PV: torch.Tensor) -> None:
        super().__init__()
        self.inner, self.bias_PV = inner, bias_PV
        self.output = nn.Identity()

    def hidden_states(self, tokens_1N, positions_1N, backend):
        logits_1NV = self.inner.output(self.inner.hidden_states(tokens_1N, positions_1N, backend))
        return logits_1NV + self.bias_PV[positions_1N]

    def forward(self, tokens_1N, positions_1N, backend):
        return self.hidden_states(tokens_1N, positions_1N, backend)


def script_bias(turns: list[tuple[int, list[int]]], eos: int, vocab: int, max_seq_len: int) -> torch.Tensor:
    """The bias that writes each (start, tokens) of `turns` + eos from position `start`, and
    never eos elsewhere."""
    bias_PV = torch.zeros(max_seq_len, vocab)
    bias_PV[:, eos] = -1e9
    for start, tokens in turns:
        for k, token in enumerate([*tokens, eos]):
            bias_PV[start + k - 1] = -1e9
            bias_PV[start + k - 1, token] = 0.0
    return bias_PV


class Idle:
    """Seconds a turn handler's `poll(block=True)` blocked: the generator had nothing to run."""

    def __init__(self, turns) -> None:
        self.turns, self.seconds = turns, 0.0
        poll = turns.poll

        def timed(block: bool):
            t0 = time.perf_counter()
            out = poll(block)
            if block:
                self.seconds += time.perf_counter() - t0
            return out

        turns.poll = timed


def run_rollout(gen, turns, start, a) -> dict:
    """One rollout: `start()` the episodes, generate, finish; its seconds and idle seconds."""
    idle = Idle(turns)
    t0 = time.perf_counter()
    prompts = start()
    started = time.perf_counter()
    gen.allocator.reset_prefix_cache()
    params = SamplingParams(max_new_tokens=a.turn_tokens, n=a.group_size, seed=0)
    try:
        completions, _ = gen.generate(prompts, params, turns=turns)
    finally:
        if hasattr(turns, "finish"):
            turns.finish()
    seconds = time.perf_counter() - t0
    episodes = list(turns.episodes.values())
    bad = [(e.failed, e.turns, e.reward) for e in episodes if e.failed or e.turns != 2 or e.reward != 1.0]
    assert not bad, f"{len(bad)} episodes did not run as scripted: {bad[:4]}"
    start_s = started - t0
    return {
        "seconds": seconds,
        "episodes_per_s": len(episodes) / seconds,
        "start_s": start_s,
        "blocked_poll_s": idle.seconds,
        "generator_idle_fraction": (start_s + idle.seconds) / seconds,
        "sample_tokens": sum(len(c.token_ids) for c in completions),
    }


def endpoint_run(gen, pool: AgentPool, tok, template, rows, a, client: str) -> dict:
    turns = AgentRollout(pool, tok, template, "hermes", 4, 10_000, 0.0, gen.eos_ids)
    rows = [{**r, "metadata": {"client": client}} for r in rows]
    return run_rollout(gen, turns, lambda: turns.start(rows, a.group_size), a)


def in_process_run(gen, pool: EnvPool, tok, template, rows, a) -> dict:
    encoder = PromptEncoder(tok, template)
    turns = MultiTurnRollout(
        pool, tok, 4, 10_000, prompt_encoder=encoder, observation_role="tool", tools=[ADD], end_of_turn_ids=gen.eos_ids
    )
    return run_rollout(gen, turns, lambda: turns.start(rows, a.group_size), a)


def turn_starts(tok: ByteTokenizer, template: ChatTemplate, prompt: str) -> tuple[int, int]:
    """The positions where the model's first and second turns start: every episode's prompt
    has the same length, and so has what the template writes between the turns."""
    messages = [{"role": "user", "content": prompt}]
    first = template.render(messages, True, [ADD])
    messages += [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "5"}]
    second = template.render(messages, True, [ADD])
    assert second.startswith(first + CALL)
    # The model's eos ends its turn; the template's text after the turn is the harness's.
    return len(tok.encode(first)), len(tok.encode(second)) + 1


def build_generator(a, tok: ByteTokenizer, starts: tuple[int, int]) -> Generator:
    args = TransformerModelArgs(
        family="qwen3", dim=a.dim, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=2 * a.dim,
        vocab_size=tok.vocab_size, qk_norm=True, max_seq_len=1024,
    )  # fmt: skip
    gen = Generator(args, GeneratorConfig(block_size=16, num_blocks=8192), torch.device("cpu"), tokenizer=tok)
    gen.wake()
    turns = [(starts[0], tok.encode(CALL)), (starts[1], tok.encode(ANSWER))]
    gen.model = ScriptedTiny(gen.model, script_bias(turns, tok.eos_id, tok.vocab_size, args.max_seq_len))
    return gen


def summarize(runs: dict[str, list[dict]]) -> tuple[dict, dict]:
    keys = ("episodes_per_s", "generator_idle_fraction", "seconds", "start_s", "blocked_poll_s")
    summary = {name: {f"median_{k}": statistics.median(r[k] for r in v) for k in keys} for name, v in runs.items()}
    inp = summary["in_process"]
    ratios = {}
    for name in ("endpoint", "endpoint_own_client"):
        end = summary[name]
        ratios[f"{name}_over_in_process_episodes_per_s"] = end["median_episodes_per_s"] / inp["median_episodes_per_s"]
        ratios[f"{name}_minus_in_process_idle_fraction"] = (
            end["median_generator_idle_fraction"] - inp["median_generator_idle_fraction"]
        )
    return summary, ratios


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=72, help="a turn's max_new_tokens (the second turn's length)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="agent workers / environment workers")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the generator (the workers are processes)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="8 episodes, one repeat: a smoke run")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.group_size, a.repeats = 4, 2, 1
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    tok, template = ByteTokenizer(), ChatTemplate(TEMPLATE)
    rows = [{"prompt": f"Task {i:04d}: add 2 and 3.", "answer": "5", "metadata": {}} for i in range(a.prompts)]
    starts = turn_starts(tok, template, rows[0]["prompt"])
    gen = build_generator(a, tok, starts)
    settings = Agent(function=AGENT_SPEC, num_workers=a.workers, timeout_s=600.0)
    # The workers import this module (torch included): give a loaded machine time to start them.
    agents = AgentPool(settings, Served("policy", 1.0, 1.0, a.turn_tokens), startup_timeout_s=300.0)
    envs = EnvPool(ENV_SPEC, {}, num_workers=a.workers, timeout_s=300.0)
    sides = {
        "endpoint": lambda rows: endpoint_run(gen, agents, tok, template, rows, a, "shared"),
        "endpoint_own_client": lambda rows: endpoint_run(gen, agents, tok, template, rows, a, "own"),
        "in_process": lambda rows: in_process_run(gen, envs, tok, template, rows, a),
    }
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    try:
        for run in sides.values():
            run(rows[: max(1, a.prompts // 16)])  # warm-up: worker imports, the first connections
        for _ in range(a.repeats):
            for name, run in sides.items():
                runs[name].append(run(rows))
    finally:
        agents.close()
        envs.close()
    assert len({r[0]["sample_tokens"] for r in runs.values()}) == 1, "the sides' samples differ"
    summary, ratios = summarize(runs)
    model = f"qwen3 dim {a.dim}, 2 layers, byte vocabulary, random weights, scripted first turn"
    return episode_report(
        a.out,
        "agent episodes: OpenAI-compatible endpoint vs in-process environment (one rank, CPU)",
        vars(a) | {"concurrent_episodes": a.prompts * a.group_size, "turn_starts": starts, "model": model},
        summary,
        ratios,
        runs,
    )


if __name__ == "__main__":
    main()
