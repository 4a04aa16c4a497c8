"""A long-prompt retrieval task: find the one numeric value in a synthetic key=value document.

    kv:fc=b;ab=7;...;hd=e|ab=  ->  7

Every key of a document is distinct (two letters of 'abcdefgh'); every value is a letter
('a'..'j') except the asked key's, a digit (the needle), so a guess is right one time in ten and
the answer can sit anywhere in the prompt: under context parallelism on another rank's shard.
The prompt grows with `num_keys` (five characters each): the long-context recipe
(train_configs/grpo_long_context_debug.toml) trains it with context parallelism.
"""

import random
from itertools import product

from titanrl.data.task_types import Sample, Task

KEYS = ["".join(p) for p in product("abcdefgh", repeat=2)]


class KeyValueRetrieval(Task):
    """'kv:<key>=<value>;...|<key>=' -> the digit stored under the asked key (the only digit)."""

    name = "kv_retrieval"

    def __init__(self, num_keys: int = 24) -> None:
        if not 1 <= num_keys <= len(KEYS):
            raise ValueError(f"kv_retrieval num_keys must be in 1..{len(KEYS)}, got {num_keys}")
        self.num_keys = num_keys

    def make(self, rng: random.Random) -> Sample:
        keys = rng.sample(KEYS, self.num_keys)
        values = [rng.choice("abcdefghij") for _ in keys]
        asked = rng.randrange(self.num_keys)
        values[asked] = str(rng.randrange(10))
        document = ";".join(f"{k}={v}" for k, v in zip(keys, values))
        return Sample(prompt=f"kv:{document}|{keys[asked]}=", answer=values[asked], solution=values[asked])

    def extract(self, completion: str) -> str | None:
        text = completion.strip()
        return text if len(text) == 1 and text.isdigit() else None
