"""The rollout viewer: one self-contained HTML page of a step's dumped episodes (`titanrl show`).

    titanrl show OUTPUT_DIR [--step N] [--out FILE]

reads <OUTPUT_DIR>/episodes.jsonl (written during RL by `titanrl/rl/episode_dump.py` when
metrics.dump_episodes > 0) and writes <OUTPUT_DIR>/episodes_step<N>.html: per episode its prompt,
reward, failure reason and finish reason, a heat strip of the generator's per-token logprobs, and
its turns, the model's tokens coloured by logprob (logprob, probability and entropy in each token's
tooltip) and the environment's tokens on a grey background, with the tool calls read from each
model turn. Inline CSS, no script, nothing fetched: the file opens anywhere. Every text from the
run is HTML-escaped.
"""

import argparse
import html
import json
import math
import os

EPISODES_FILE = "episodes.jsonl"
"""The dump's file name inside the run's dump folder."""

_CSS = """
body { font-family: system-ui, sans-serif; margin: 16px; background: #fafafa; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px; } .meta { color: #555; font-size: 13px; margin-bottom: 12px; }
.episode { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 10px 12px; margin: 0 0 14px; }
.episode h2 { font-size: 15px; margin: 0 0 6px; } .ok { color: #1a7f37; } .bad { color: #b42318; }
.facts span { display: inline-block; margin-right: 14px; font-size: 13px; }
.prompt { background: #f3f3f3; padding: 6px; font-size: 12px; white-space: pre-wrap; margin: 6px 0; }
.strip { display: flex; height: 10px; margin: 6px 0; border: 1px solid #ccc; }
.strip .cell { flex: 1 1 0; min-width: 1px; } .strip .cell.env { background: #9e9e9e; }
.turn { border-left: 4px solid #5b8def; padding: 2px 8px; margin: 6px 0; }
.turn.env { border-left-color: #9e9e9e; background: #f1f1f1; }
.role { font-size: 11px; text-transform: uppercase; color: #666; }
.tokens { font-family: ui-monospace, monospace; font-size: 13px; white-space: pre-wrap; line-height: 1.7; }
.tok { border-radius: 2px; padding: 1px 0; } .tok.env { background: #d6d6d6; color: #444; font-style: italic; }
.tok.special { font-size: 10px; color: #666; border: 1px dotted #999; }
.calls { font-size: 12px; margin: 2px 0 4px; } .calls code { background: #eef3ff; padding: 1px 4px; }
.legend { font-size: 13px; margin-bottom: 10px; }
.legend span { display: inline-block; padding: 1px 6px; margin-right: 6px; font-size: 12px; }
"""


def read_episodes(folder: str) -> dict[int, list[dict]]:
    """{step: its dumped episodes} of <folder>/episodes.jsonl; a step dumped again (a resumed run
    that redid it) keeps its latest rows, a torn last line is skipped. ValueError naming the fix
    when the folder has no dump."""
    path = os.path.join(folder, EPISODES_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"'{path}' not found: run the job with metrics.dump_episodes > 0 (the default is 4) and "
            "give `titanrl show` its job.dump_folder"
        )
    steps: dict[int, list[dict]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut off by a killed run
            if row["index"] == 0:
                steps[row["step"]] = []
            steps.setdefault(row["step"], []).append(row)
    if not steps:
        raise ValueError(f"'{path}' holds no episodes yet: the run dumps them every metrics.log_freq steps")
    return steps


def pick_step(steps: dict[int, list[dict]], step: int | None) -> int:
    """`step`, or the last one dumped; ValueError listing the dumped steps when it is not one."""
    if step is None:
        return max(steps)
    if step not in steps:
        dumped = [str(s) for s in sorted(steps)]
        shown = ", ".join(dumped if len(dumped) <= 12 else dumped[:6] + ["..."] + dumped[-5:])
        raise ValueError(f"--step {step} was not dumped; the dumped steps are {shown} (every metrics.log_freq steps)")
    return step


def heat(logprob: float) -> str:
    """Background colour of a token sampled with `logprob`: green (likely) through red (unlikely)."""
    p = math.exp(min(logprob, 0.0))
    return f"hsl({round(120 * p)}, 70%, {round(88 - 8 * p)}%)"


def token_title(tid: int, logprob: float, entropy: float | None, model: int) -> str:
    if not model:
        return f"id {tid} | environment token"
    ent = f" | entropy {entropy:.3f}" if entropy is not None else ""
    return f"id {tid} | logprob {logprob:.3f} | p {math.exp(min(logprob, 0.0)):.3f}{ent}"


def render_token(ep: dict, i: int) -> str:
    tid, piece, model, lp = ep["token_ids"][i], ep["pieces"][i], ep["model_mask"][i], ep["logprobs"][i]
    entropy = ep["entropies"][i] if ep.get("entropies") else None
    classes = ["tok"] + ([] if model else ["env"]) + ([] if piece else ["special"])
    style = f' style="background:{heat(lp)}"' if model else ""
    title = html.escape(token_title(tid, lp, entropy, model))
    name = (ep.get("special_tokens") or {}).get(str(tid), str(tid))  # a token that adds no text
    text = html.escape(piece) if piece else f"&lt;{html.escape(name)}&gt;"
    return f'<span class="{" ".join(classes)}"{style} title="{title}">{text}</span>'


def render_strip(ep: dict) -> str:
    cells = []
    for lp, model in zip(ep["logprobs"], ep["model_mask"]):
        if model:
            cells.append(f'<span class="cell" style="background:{heat(lp)}" title="logprob {lp:.3f}"></span>')
        else:
            cells.append('<span class="cell env" title="environment token"></span>')
    return f'<div class="strip">{"".join(cells)}</div>'


def render_calls(turn: dict) -> str:
    parts = []
    for call in turn.get("tool_calls") or []:
        name = call["name"] if call["name"] is not None else "tool"
        args = json.dumps(call["arguments"], ensure_ascii=False) if call["arguments"] else call["text"]
        parts.append(f"<code>{html.escape(name)}({html.escape(args)})</code>")
    if turn.get("tool_error"):
        parts.append(f'<span class="bad">malformed tool call: {html.escape(turn["tool_error"])}</span>')
    return f'<div class="calls">tool calls: {" ".join(parts)}</div>' if parts else ""


def render_turns(ep: dict) -> str:
    out, model_turns = [], 0
    for turn in ep["turns"]:
        model = turn["role"] == "model"
        model_turns += model
        label = f"model turn {model_turns}" if model else "environment"
        tokens = "".join(render_token(ep, i) for i in range(turn["start"], turn["end"]))
        calls = render_calls(turn) if model else ""
        out.append(
            f'<div class="turn {turn["role"]}"><div class="role">{label}</div>{calls}'
            f'<div class="tokens">{tokens}</div></div>'
        )
    return "".join(out)


def render_episode(ep: dict) -> str:
    failed = ep.get("failed")
    outcome = '<span class="ok">correct</span>' if ep["correct"] else '<span class="bad">incorrect</span>'
    facts = [
        f"reward <b>{ep['reward']:.4g}</b>",
        outcome,
        f"finish {html.escape(str(ep['finish_reason']))}",
        f"{len(ep['token_ids'])} tokens ({len(ep['token_ids']) - sum(ep['model_mask'])} environment)",
    ]
    if ep.get("turn_rewards"):
        facts.append("turn rewards " + html.escape(", ".join(f"{r:.3g}" for r in ep["turn_rewards"])))
    facts.append(f'<span class="bad">failed: {html.escape(failed)}</span>' if failed else "failed: none")
    return (
        f'<div class="episode" id="episode-{ep["index"]}"><h2>episode {ep["index"]} (sample {ep["sample"]})</h2>'
        f'<div class="facts">{"".join(f"<span>{x}</span>" for x in facts)}</div>'
        f'<div class="prompt">{html.escape(ep["prompt"])}</div>{render_strip(ep)}{render_turns(ep)}</div>'
    )


def render_page(folder: str, step: int, episodes: list[dict], all_steps: list[int]) -> str:
    """The whole HTML page of `step`'s `episodes`."""
    mean = sum(e["reward"] for e in episodes) / max(len(episodes), 1)
    legend = (
        '<div class="legend">token colour = generator probability: '
        f'<span style="background:{heat(0.0)}">p = 1</span>'
        f'<span style="background:{heat(math.log(0.5))}">p = 0.5</span>'
        f'<span style="background:{heat(math.log(0.05))}">p = 0.05</span>'
        '<span class="tok env">environment token</span> (hover a token for its logprob)</div>'
    )
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>titanrl episodes, step {step}</title><style>{_CSS}</style></head><body>"
        f"<h1>Step {step}: {len(episodes)} sampled episodes</h1>"
        f'<div class="meta">{html.escape(folder)} | mean reward {mean:.4g} | '
        f"dumped steps {html.escape(_step_range(all_steps))}</div>{legend}"
        + "".join(render_episode(e) for e in episodes)
        + "</body></html>\n"
    )


def _step_range(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]} ({len(steps)})" if len(steps) > 1 else str(steps[0])


def write_page(folder: str, step: int | None = None, out: str | None = None) -> str:
    """Render `step` (default: the last dumped) of `folder`'s dump to `out` (default
    <folder>/episodes_step<N>.html); returns the page's path. ValueError on a user error."""
    steps = read_episodes(folder)
    chosen = pick_step(steps, step)
    path = out or os.path.join(folder, f"episodes_step{chosen}.html")
    page = render_page(folder, chosen, steps[chosen], sorted(steps))
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path


SHOW_HELP = """Write one self-contained HTML page of the episodes a run dumped at a step
(<OUTPUT_DIR>/episodes.jsonl, metrics.dump_episodes per metrics.log_freq steps): each turn, tool
calls, environment tokens marked, per-token logprobs as a heat strip, reward and failure reason.
Open it in any browser (docs/viewer.md)."""


def add_show_arguments(parser: argparse.ArgumentParser) -> None:
    """The `titanrl show` command's arguments."""
    parser.add_argument("folder", metavar="OUTPUT_DIR", help="the run's job.dump_folder")
    parser.add_argument("--step", type=int, metavar="N", help="the step to show (default: the last dumped)")
    parser.add_argument("--out", metavar="FILE", help="the page's file (default <OUTPUT_DIR>/episodes_step<N>.html)")
