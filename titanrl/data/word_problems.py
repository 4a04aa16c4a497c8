"""`tool_multiply`: word problems that multiply a 3-digit by a 2-digit number, to be solved with a
calculator tool called in the Hermes / Qwen JSON format ("A theatre has 34 rows of 128 seats. How
many seats does it have?" -> a `calculator` call with "128*34", its result 4352, "The answer is
4352.").

Why this task for a real pretrained model on a CPU: SmolLM2-135M-Instruct cannot multiply such
numbers in its head (its exact accuracy is near 0), so a rise in held-out accuracy means the model
learned to call the tool with the problem's numbers and to copy the tool's result into its answer.

Each row carries its chat (`metadata['messages']`: a system message that describes the tool and its
call format, then the question), which an agent sends as its first call with the tool's JSON schema
(`CALCULATOR`; train_configs/agent_calculator.py), and a worked episode
(`metadata['demo_messages']`: the assistant's call, the tool's result, the answer), rendered by the
model's own chat template for the SFT warm-up with the tool's turn masked out of the loss.

Number pairs are split once into disjoint train and held-out sets (by a hash of the pair, one in
`eval_every`), so held-out problems are never trained on. Held-out accuracy counts episodes whose
final answer is exactly the product.
"""

import json
import random
import re
import zlib

from titanrl.data.task_types import Sample, Task

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 128*34"}},
            "required": ["expression"],
        },
    },
}
"""The tool's OpenAI / JSON-schema description (what an agent sends as `tools`)."""

SYSTEM = (
    "You have a calculator. Call it with\n<tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "<expression>"}}\n</tool_call>\n'
    "then reply: The answer is <number>."
)
"""The system message: the tool and its Hermes / Qwen call format (the schema goes to the endpoint
as `tools`; SmolLM2's template does not render tools, and a short prompt keeps episodes cheap)."""

TEMPLATES = [
    "A theatre has {b} rows of {a} seats. How many seats does it have?",
    "A school buys {b} packs of {a} sheets of paper. How many sheets does it buy?",
    "A farmer plants {b} rows of {a} trees. How many trees does the farmer plant?",
    "A train travels {a} kilometres every day for {b} days. How many kilometres does it travel?",
    "A warehouse has {a} boxes with {b} bottles in each box. How many bottles are there in total?",
    "Each of {b} students reads {a} pages. How many pages do they read altogether?",
    "A baker makes {a} loaves of bread a day for {b} days. How many loaves does the baker make?",
    "A factory fills {b} crates with {a} apples each. How many apples does it pack?",
    "A library has {b} shelves with {a} books on each shelf. How many books does it have?",
    "A shop sells {a} pens a week for {b} weeks. How many pens does it sell?",
]

_LAST_INT = re.compile(r"-?\d[\d,]*")


def tool_call_text(expression: str) -> str:
    """The assistant's call of the calculator in the Hermes / Qwen format."""
    arguments = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(arguments)}\n</tool_call>"


def final_answer(text: str) -> str | None:
    """The last integer of a reply (thousands separators dropped), or None."""
    numbers = _LAST_INT.findall(text or "")
    return numbers[-1].replace(",", "") if numbers else None


class ToolMultiply(Task):
    """Word problems a x b (a 3-digit, b 2-digit) solved with a calculator (module docstring)."""

    name = "tool_multiply"

    def __init__(self, eval_every: int = 8) -> None:
        self.eval_every = eval_every
        self.system = SYSTEM

    def held_out(self, a: int, b: int) -> bool:
        return zlib.crc32(f"{a}x{b}".encode()) % self.eval_every == 0

    def _draw(self, rng: random.Random, held_out: bool) -> Sample:
        while True:
            a, b = rng.randint(100, 999), rng.randint(11, 99)
            if self.held_out(a, b) == held_out:
                break
        question = rng.choice(TEMPLATES).format(a=a, b=b)
        answer = str(a * b)
        demo = [
            {"role": "assistant", "content": tool_call_text(f"{a}*{b}")},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": f"The answer is {answer}."},
        ]
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": question}]
        metadata = {"messages": messages, "demo_messages": demo, "data_source": "tool_multiply"}
        return Sample(prompt=question, answer=answer, solution=f"The answer is {answer}.", metadata=metadata)

    def make(self, rng: random.Random) -> Sample:
        return self._draw(rng, held_out=False)

    def samples(self, split: str, n: int, seed: int) -> list[Sample]:
        """Training draws from the training pairs; held out ('eval') from the held-out pairs."""
        rng = random.Random(f"{self.name}/{split}/{seed}")
        return [self._draw(rng, held_out=split == "eval") for _ in range(n)]

    def extract(self, completion: str) -> str | None:
        return final_answer(completion)
