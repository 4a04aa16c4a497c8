"""`short_answer`: everyday questions a small instruction-tuned model partly knows, asked to be
answered with only the answer ("What is the capital of Italy? Answer with only the city name." ->
"Rome").

Why this task for a real pretrained model on a CPU: SmolLM2-135M-Instruct names the right answer
in about half of its sampled replies but wraps it in a sentence ("The capital of Italy is Rome."),
so the instruction it is given is not followed; replies are a few tokens, so a GRPO step is cheap.
A reply that is exactly the answer (case, punctuation and a leading "the" ignored) is correct and
earns 1; a reply that contains the answer among other words earns `partial_weight` times (1 +
the answer's share of its words), the learning signal before the model answers tersely ("Rome,
Italy" earns 0.75, "The capital of Italy is Rome" 0.58); anything else earns 0. Held-out accuracy counts
exact answers only.

The facts are split once, by position, into disjoint train and held-out sets (every
`eval_every`-th fact of each kind is held out), so held-out questions are never trained on.
"""

import random
import re

from titanrl.data.task_types import Sample, Score, Task

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"),
    ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Austria", "Vienna"),
    ("Poland", "Warsaw"), ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Belgium", "Brussels"), ("Netherlands", "Amsterdam"), ("Hungary", "Budapest"),
    ("Czech Republic", "Prague"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"),
    ("Croatia", "Zagreb"), ("Ukraine", "Kyiv"), ("Turkey", "Ankara"), ("Iran", "Tehran"),
    ("Iraq", "Baghdad"), ("Saudi Arabia", "Riyadh"), ("Israel", "Jerusalem"), ("Lebanon", "Beirut"),
    ("Syria", "Damascus"), ("Jordan", "Amman"), ("India", "New Delhi"), ("Pakistan", "Islamabad"),
    ("Bangladesh", "Dhaka"), ("Nepal", "Kathmandu"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("South Korea", "Seoul"), ("North Korea", "Pyongyang"), ("Indonesia", "Jakarta"), ("Philippines", "Manila"),
    ("Malaysia", "Kuala Lumpur"), ("Singapore", "Singapore"), ("Afghanistan", "Kabul"), ("Mongolia", "Ulaanbaatar"),
    ("Kenya", "Nairobi"), ("Ethiopia", "Addis Ababa"), ("Nigeria", "Abuja"), ("Ghana", "Accra"),
    ("Morocco", "Rabat"), ("Algeria", "Algiers"), ("Tunisia", "Tunis"), ("Libya", "Tripoli"),
    ("Sudan", "Khartoum"), ("Uganda", "Kampala"), ("Senegal", "Dakar"), ("Zimbabwe", "Harare"),
    ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Cuba", "Havana"), ("Brazil", "Brasilia"),
    ("Argentina", "Buenos Aires"), ("Chile", "Santiago"), ("Peru", "Lima"), ("Colombia", "Bogota"),
    ("Venezuela", "Caracas"), ("Ecuador", "Quito"), ("Uruguay", "Montevideo"), ("Australia", "Canberra"),
    ("New Zealand", "Wellington"), ("Iceland", "Reykjavik"), ("Switzerland", "Bern"), ("Scotland", "Edinburgh"),
    ("England", "London"), ("Wales", "Cardiff"), ("Jamaica", "Kingston"), ("Qatar", "Doha"),
]  # fmt: skip

OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("happy", "sad"), ("fast", "slow"),
    ("light", "dark"), ("open", "closed"), ("day", "night"), ("wet", "dry"), ("early", "late"),
    ("full", "empty"), ("hard", "soft"), ("high", "low"), ("long", "short"), ("rich", "poor"),
    ("strong", "weak"), ("thick", "thin"), ("loud", "quiet"), ("clean", "dirty"), ("heavy", "light"),
    ("push", "pull"), ("win", "lose"), ("buy", "sell"), ("first", "last"), ("inside", "outside"),
    ("left", "right"), ("black", "white"), ("north", "south"), ("east", "west"), ("true", "false"),
    ("yes", "no"), ("love", "hate"), ("friend", "enemy"), ("begin", "end"), ("give", "take"),
    ("enter", "exit"), ("arrive", "leave"), ("alive", "dead"), ("awake", "asleep"), ("cheap", "expensive"),
    ("deep", "shallow"), ("easy", "difficult"), ("wide", "narrow"), ("sweet", "sour"), ("safe", "dangerous"),
    ("remember", "forget"), ("accept", "refuse"), ("increase", "decrease"), ("maximum", "minimum"), ("before", "after"),
    ("above", "below"), ("always", "never"), ("question", "answer"), ("summer", "winter"), ("young", "old"),
]  # fmt: skip

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
]  # fmt: skip


def _questions() -> dict[str, list[tuple[str, str]]]:
    """(question, answer) pairs of each kind, in a fixed order."""
    after = [
        (f"Which day of the week comes after {d}? Answer with only the day.", DAYS[(i + 1) % 7])
        for i, d in enumerate(DAYS)
    ]
    after += [
        (f"Which month comes after {m}? Answer with only the month.", MONTHS[(i + 1) % 12])
        for i, m in enumerate(MONTHS)
    ]
    return {
        "capital": [(f"What is the capital of {c}? Answer with only the city name.", a) for c, a in CAPITALS],
        "opposite": [(f"What is the opposite of '{w}'? Answer with one word.", a) for w, a in OPPOSITES],
        "next": after,
    }


def normalize(text: str) -> str:
    """Lower case, letters, digits and single spaces only, without a leading article."""
    words = re.sub(r"[^a-z0-9 ]+", " ", text.lower()).split()
    if len(words) > 1 and words[0] in ("the", "a", "an"):
        words = words[1:]
    return " ".join(words)


class ShortAnswer(Task):
    """Everyday questions answered with only the answer (module docstring: why, and the reward)."""

    name = "short_answer"

    def __init__(self, eval_every: int = 4, partial_weight: float = 0.5) -> None:
        self.partial_weight = partial_weight
        self.splits: dict[str, list[tuple[str, str, str]]] = {"train": [], "eval": []}
        for kind, pairs in _questions().items():
            for i, (question, answer) in enumerate(pairs):
                split = "eval" if i % eval_every == eval_every - 1 else "train"
                self.splits[split].append((question, answer, kind))

    def make(self, rng: random.Random) -> Sample:
        question, answer, kind = rng.choice(self.splits["train"])
        return Sample(prompt=question, answer=answer, solution=answer, metadata={"data_source": kind})

    def samples(self, split: str, n: int, seed: int) -> list[Sample]:
        """Training: `n` draws from the training facts. Held out: the first `n` held-out facts in
        a fixed shuffled order, each once (fewer if there are fewer)."""
        if split != "eval":
            return super().samples(split, n, seed)
        facts = list(self.splits["eval"])
        random.Random(f"{self.name}/eval/{seed}").shuffle(facts)
        return [Sample(prompt=q, answer=a, solution=a, metadata={"data_source": k}) for q, a, k in facts[:n]]

    def extract(self, completion: str) -> str | None:
        text = normalize(completion)
        return text or None

    def score(self, completion: str, answer: str, metadata: dict) -> Score:
        reply, target = normalize(completion), normalize(answer)
        if reply == target:
            return Score(1.0, True, True)
        if re.search(rf"(^| ){re.escape(target)}( |$)", reply):
            # Fewer extra words, more reward: the signal that leads from sentences to answers.
            words, needed = len(reply.split()), len(target.split())
            return Score(self.partial_weight * (1.0 + needed / words), False, True)
        return Score(0.0, False, bool(reply))
