"""Multi-turn samples between their turns, with the environment (`TurnHandler`).

A sample whose turn ended (eos, stop string, length) is handed to the environment and waits,
holding its KV blocks, while the other samples keep decoding. The environment answers with an
observation, which resumes the sample (its tokens appended and prefilled), or ends the episode.
"""

from titanrl.generator.sequence import Seq, TurnHandler


class TurnExchange:
    """The samples of one `generate` call waiting on an environment step, by (prompt, sample)."""

    def __init__(self, turns: TurnHandler, max_seq_len: int, vocab_size: int) -> None:
        self.turns = turns
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.paused: dict[tuple[int, int], Seq] = {}

    def hand_over(self, finished: list[Seq]) -> list[Seq]:
        """Hand the samples of `finished` whose turn just ended to the environment (they keep
        their KV blocks); returns the others, in order (episodes that are over)."""
        kept = []
        for seq in finished:
            reason = seq.finish_reason
            if reason is None or reason.startswith("done"):
                kept.append(seq)
                continue
            key = (seq.prompt_index, seq.sample_index)
            self.paused[key] = seq
            turn = seq.turn_token_ids
            record = getattr(self.turns, "record_logprobs", None)
            if record is not None:  # a handler that returns the turn's logprobs (the agent endpoint)
                record(key, seq.logprobs[len(seq.logprobs) - len(turn) :])
            self.turns.submit(key, turn, reason)
        return kept

    def collect(self, block: bool) -> tuple[list[Seq], list[Seq]]:
        """The samples whose environment step is done (waiting for one if `block`): (resumed,
        their observation appended, in the environment's order; ended, with finish_reason
        'done:<reason>'). The caller frees an ended sample's blocks."""
        resumed, ended = [], []
        for key, obs in self.turns.poll(block):
            seq = self.paused.pop(key)
            assert seq.finish_reason is not None, "a paused sample without the reason its turn ended"
            if obs is None or len(seq.token_ids) + len(obs) >= self.max_seq_len:
                seq.finish_reason = "done:" + seq.finish_reason if obs is None else "done:length"
                ended.append(seq)
                continue
            if any(not 0 <= t < self.vocab_size for t in obs) or not obs:
                raise ValueError(f"observation for sample {key} has no tokens or ids outside the vocabulary")
            seq.append_observation(obs)
            resumed.append(seq)
        return resumed, ended
