"""A prompt as token ids, the same way for generation, SFT, preferences and evaluation; and the
check, before step 1, that every data row fits the model's context once encoded.

A row too long in tokens would otherwise fail (or be cut) only when it is drawn, mid-run, with
no file or line to find it by. The `fit_*` functions encode every row of a data file at start-up
exactly as its recipe will (chat template included), and treat the ones over the limit as
`data.on_long_prompt` says, like `data.max_prompt_chars` at load: 'drop' (the default) drops
them and prints how many, naming the first rows' file:line; 'error' stops on the first, naming
it. Their cost is the tokenizer's, paid once per rank, at the same time.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from titanrl.components.console import get_logger
from titanrl.config.data import Data
from titanrl.data.formats import sample_where
from titanrl.data.prompts import is_rank0, listed
from titanrl.data.tasks import Sample
from titanrl.models.chat_template import ChatTemplate
from titanrl.models.tokenizer import Tokenizer

log = get_logger(__name__)

if TYPE_CHECKING:
    from titanrl.config import JobConfig
    from titanrl.data.preferences import PreferencePair

Row = TypeVar("Row")


class PromptEncoder:
    """bos + the prompt text; or, with a chat template, the rendering of the prompt's messages
    (a row's 'messages' metadata, else the text as one user message) with the generation prompt."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None = None, system_prompt: str = "") -> None:
        self.tokenizer, self.template, self.system_prompt = tokenizer, template, system_prompt

    @classmethod
    def from_config(cls, data: Data, tokenizer_folder: str, tokenizer: Tokenizer) -> "PromptEncoder":
        if not data.chat_template:
            return cls(tokenizer)
        if tokenizer_folder == "byte":
            raise ValueError("[data] chat_template needs model.tokenizer to be a folder with a chat template")
        return cls(tokenizer, ChatTemplate.from_folder(tokenizer_folder), data.system_prompt)

    def messages(self, prompt: str, metadata: dict | None = None) -> list[dict]:
        messages = list((metadata or {}).get("messages") or [{"role": "user", "content": prompt}])
        if self.system_prompt and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def __call__(self, prompt: str, metadata: dict | None = None) -> list[int]:
        if self.template is None:
            bos = [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []
            return bos + self.tokenizer.encode(prompt)
        return self.template.encode(self.tokenizer, self.messages(prompt, metadata), add_generation_prompt=True)


# ---- does every row fit the context? ----


def fit_rows(
    train: list[Row] | None,
    held_out: list[Row],
    size: Callable[[Row], int],
    max_tokens: int,
    on_long_prompt: str,
    what: str,
    limit: str,
    fix: str,
) -> tuple[list[Row] | None, list[Row]]:
    """(train, held_out) without the rows whose `size` (tokens) is over `max_tokens`: dropped
    with one printed line naming the first ones (`on_long_prompt='drop'`), else an error naming
    the first one and counting the rest ('error'). `train` None (an endless task stream) stays None.

    `what` names the measured tokens ("encoded prompt"), `limit` says where `max_tokens` comes
    from, `fix` how to make the rows fit; a row's `size` raising ValueError (a chat template that
    rejects its messages) is an error naming the row."""
    over: list[tuple[str, int]] = []
    kept: list[list[Row]] = []
    for rows in (train or [], held_out):
        keep = []
        for i, row in enumerate(rows):
            try:
                n = size(row)
            except ValueError as e:
                raise ValueError(f"{sample_where(row, i)}: {e}") from None
            if n > max_tokens:
                over.append((sample_where(row, i), n))
            else:
                keep.append(row)
        kept.append(keep)
    if not over:
        return train, held_out
    if on_long_prompt == "error":
        where, n = over[0]
        others = f" ({len(over)} rows are over: {listed(over, 'tokens')})" if len(over) > 1 else ""
        raise ValueError(
            f"{where}: the {what} has {n} tokens, more than the {max_tokens} that fit ({limit}); {fix}, "
            f"or set data.on_long_prompt='drop' to skip such rows{others}"
        )
    total = len(train or []) + len(held_out)
    if is_rank0():
        log.info(
            f"dropped {len(over)} of {total} rows whose {what} is over {max_tokens} tokens ({limit}): "
            f"{listed(over, 'tokens')}; {fix} (data.on_long_prompt='error' stops on them instead)"
        )
    named: tuple[tuple[list[Row] | None, list[Row], str], ...] = (
        (train, kept[0], "training rows"),
        (held_out, kept[1], "held-out rows (data.num_eval_samples)"),
    )
    for given, left, name in named:
        if given and not left:
            raise ValueError(
                f"no {name} are left after dropping the {len(over)} whose {what} is over "
                f"{max_tokens} tokens ({limit}); {fix}"
            )
    return (None if train is None else kept[0]), kept[1]


def prompt_room(max_seq_len: int, max_new_tokens: int) -> tuple[int, str]:
    """(most prompt tokens that leave room for a whole completion, where that number comes from)."""
    max_prompt = max_seq_len - max_new_tokens
    if max_prompt < 1:
        raise ValueError(
            f"generator.max_new_tokens ({max_new_tokens}) leaves no room for a prompt in the model's "
            f"{max_seq_len}-token context; lower it or raise model.max_seq_len"
        )
    return max_prompt, f"model.max_seq_len {max_seq_len} - generator.max_new_tokens {max_new_tokens}"


def demonstration_size(encode: PromptEncoder, sample: Sample) -> int:
    """Tokens of a sample's SFT sequence as `recipes.sft.demonstration` builds it: the encoded
    prompt, each part of the demonstration (metadata 'demo', else the solution), then eos."""
    demo = sample.metadata.get("demo") or [[sample.solution, True]]
    return len(encode(sample.prompt, sample.metadata)) + sum(len(encode.tokenizer.encode(t)) for t, _ in demo) + 1


def fit_prompts(
    config: "JobConfig", max_seq_len: int, encode: PromptEncoder, train: list[Sample] | None, held_out: list[Sample]
) -> tuple[list[Sample] | None, list[Sample]]:
    """RL on a data file: every prompt, encoded for generation, leaves room for a whole
    completion (generator.max_new_tokens) in the context; with an SFT warm-up, every training
    row's prompt + solution fits it too. Embedded tasks (short, generated) and environments (the
    first prompt is the environment's observation, not the row's) are not checked."""
    if not config.data.path or config.env.name or config.agent.function:
        return train, held_out
    max_prompt, limit = prompt_room(max_seq_len, config.generator.max_new_tokens)
    on_long = config.data.on_long_prompt
    train, held_out = fit_rows(
        train,
        held_out,
        lambda s: len(encode(s.prompt, s.metadata)),
        max_prompt,
        on_long,
        "encoded prompt",
        limit,
        "shorten or filter these rows (data.max_prompt_chars drops long prompts by characters), raise "
        "model.max_seq_len or lower generator.max_new_tokens",
    )
    if config.sft_warmup.steps:
        train, _ = fit_rows(
            train,
            [],
            lambda s: demonstration_size(encode, s),
            max_seq_len,
            on_long,
            "encoded prompt + solution (SFT warm-up)",
            f"model.max_seq_len {max_seq_len}",
            "shorten or filter these rows or raise model.max_seq_len",
        )
    return train, held_out


def fit_demonstrations(
    config: "JobConfig", max_seq_len: int, encode: PromptEncoder, train: list[Sample], held_out: list[Sample]
) -> tuple[list[Sample], list[Sample]]:
    """SFT on a data file: every row's encoded prompt + solution + eos fits the context."""
    if not config.data.path:
        return train, held_out
    kept, kept_held_out = fit_rows(
        train,
        held_out,
        lambda s: demonstration_size(encode, s),
        max_seq_len,
        config.data.on_long_prompt,
        "encoded prompt + solution",
        f"model.max_seq_len {max_seq_len}",
        "shorten or filter these rows or raise model.max_seq_len",
    )
    assert kept is not None, "fit_rows keeps a list for a list"
    return kept, kept_held_out


def fit_pairs(
    config: "JobConfig",
    max_seq_len: int,
    encode: PromptEncoder,
    train: list["PreferencePair"],
    held_out: list["PreferencePair"],
) -> tuple[list["PreferencePair"], list["PreferencePair"]]:
    """DPO / reward model on a data file: every pair's encoded prompt + its longer answer + eos
    fits the context (as `recipes.preference` encodes them)."""
    if not config.data.path:
        return train, held_out
    tokenizer = encode.tokenizer

    def size(pair: "PreferencePair") -> int:
        answers = max(len(tokenizer.encode(pair.chosen)), len(tokenizer.encode(pair.rejected)))
        return len(encode(pair.prompt)) + answers + 1

    kept, kept_held_out = fit_rows(
        train,
        held_out,
        size,
        max_seq_len,
        config.data.on_long_prompt,
        "encoded prompt + longer answer",
        f"model.max_seq_len {max_seq_len}",
        "shorten or filter these rows or raise model.max_seq_len",
    )
    assert kept is not None, "fit_rows keeps a list for a list"
    return kept, kept_held_out
