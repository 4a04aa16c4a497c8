"""A prompt as token ids, the same way for generation, SFT, preferences and evaluation."""

from titanrl.config.sections import Data
from titanrl.models.chat_template import ChatTemplate
from titanrl.models.tokenizer import Tokenizer


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
