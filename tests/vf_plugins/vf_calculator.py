"""A verifiers (`verifiers.v1`) taskset with its own harness, for tests: the calculator task as a
verifiers environment. Its id is this module's name (`vf_calculator`; verifiers imports a taskset
by id, so tests put this folder on the path).

The harness is an agent program in the harness's own process: it asks the model through the
OpenAI-compatible endpoint verifiers hands it, runs `<tool>EXPR</tool>` calls (answered as a user
message `<result>VALUE</result>`) and stops at the first turn without a call. The task's reward
(`correct`, verifiers' scoring) is 1 when the last reply's text after its last result is the
answer. Prompts containing 'RAISE', 'HANG' or 'REWRITE' make the harness raise, hang or edit
the model's turns (fault tests); 'TOOLS' makes it declare the calculator tool in its requests.
"""

import asyncio
import re

import httpx
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

from titanrl.data.task_types import safe_arithmetic
from titanrl.envs.builtin import CALCULATOR_TOOL


class CalcData(vf.TaskData):
    answer: str = ""


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        tail = (trace.last_reply or "").rsplit("</result>", 1)[-1].strip()
        return 1.0 if tail == self.data.answer else 0.0


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        for a, b in [(4, 37), (12, 12), (7, 8)]:
            yield CalcTask(CalcData(prompt=f"{a} boxes of {b} pens. pens? ", answer=str(a * b)), self.config.task)


class CalcHarnessConfig(vf.HarnessConfig):
    max_calls: int = 8


class CalcHarness(vf.Harness[CalcHarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False
    SUPPORTS_RESUME = True

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):  # noqa: ANN001, ANN201
        if "RAISE" in data.prompt_text:
            raise RuntimeError("the calculator harness broke")
        if "HANG" in data.prompt_text:
            await asyncio.sleep(3600)
        messages = [{"role": "user", "content": data.prompt_text}]
        headers = {"Authorization": f"Bearer {secret}"}
        async with httpx.AsyncClient(timeout=600.0) as http:
            for _ in range(self.config.max_calls):
                body = {"model": ctx.model, "messages": messages}
                if "TOOLS" in data.prompt_text:  # a harness that declares its tool (OpenAI schema)
                    body["tools"] = [CALCULATOR_TOOL]
                reply = await http.post(endpoint.rstrip("/") + "/chat/completions", headers=headers, json=body)
                if reply.status_code != 200:
                    return ProgramResult(1, "", reply.text)
                text = reply.json()["choices"][0]["message"]["content"] or ""
                # 'REWRITE': the harness edits the model's turn (a fault: not what the model said).
                messages.append({"role": "assistant", "content": text + ("!" if "REWRITE" in data.prompt_text else "")})
                call = re.search(r"<tool>(.*?)</tool>", text, re.S)
                if call is None:
                    break
                try:
                    value, _ = safe_arithmetic(call.group(1), 64)
                    result = str(int(value)) if value == int(value) else f"{value:.6g}"
                except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, RecursionError):
                    result = "error"
                messages.append({"role": "user", "content": f"<result>{result}</result>"})
        return ProgramResult(0, "", "")


def env_config() -> vf.SingleAgentEnvConfig:
    """`[env] verifiers = "vf_calculator:env_config"`: the same, named through a factory."""
    return vf.SingleAgentEnvConfig(
        taskset=vf.TasksetConfig(id="vf_calculator"), agent=vf.AgentConfig(runtime=vf.SubprocessConfig())
    )


def not_a_config() -> dict:
    """A wrong factory (tests: `[env] verifiers` names what it returns)."""
    return {}


__all__ = ["CalcHarness", "CalcTaskset"]
