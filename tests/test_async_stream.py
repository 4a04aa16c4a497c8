"""The generator's stream (`Generator.stream`), what asynchronous RL's rollout ranks run: groups
join while others decode, and the weights are swapped between two passes with the samples in
flight and their KV kept (PipelineRL), each token stamped with the version that sampled it."""

import pytest
import torch
from helpers.tiny import tiny_model, tiny_model_args

from titanrl.config.generation import Generator as GeneratorConfig
from titanrl.generator import Generator, SamplingParams
from titanrl.generator.stream import forget_prefixes, stream
from titanrl.models.logprobs import token_logprobs

ARGS = tiny_model_args()
TOL = 1e-5  # float32 logprobs of a paged decode against one full forward


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 100, (n,), generator=g).tolist() for n in lengths]


def _teacher_forced(model, prompt, tokens):
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(seq[:, :-1])
    return token_logprobs(logits, seq[:, 1:])[0, len(prompt) - 1 :].tolist()


class Feed:
    """Adds `batches` of prompts (each once the previous is done, or all at once), swaps to
    `new_model` after `swap_after` passes, and keeps the finished samples."""

    def __init__(self, gen, batches, seeds, *, new_model=None, swap_after=0, recompute=False, all_at_once=False):
        self.gen, self.batches, self.seeds = gen, list(batches), seeds
        self.new_model, self.swap_after, self.recompute = new_model, swap_after, recompute
        self.all_at_once, self.version, self.passes, self.done = all_at_once, 0, 0, []
        self.next_id = 0

    def __call__(self, sched) -> bool:
        sched.stamp_versions(self.version)
        self.done.extend(s.to_completion(None) for s in sched.take_finished())
        if self.new_model is not None and self.passes == self.swap_after:
            with torch.no_grad():
                for dst, src in zip(self.gen.model.parameters(), self.new_model.parameters()):
                    dst.copy_(src)
            forget_prefixes(self.gen)
            if self.recompute:
                sched.recompute_all()
            self.version += 1
        self.passes += 1
        while self.batches and (self.all_at_once or not sched.has_work):
            prompts = self.batches.pop(0)
            ids = list(range(self.next_id, self.next_id + len(prompts)))
            self.next_id += len(prompts)
            sched.add_prompts(prompts, ids, [self.seeds] * len(prompts))
        return sched.has_work


def _gen(model, **config):
    gen = Generator(ARGS, GeneratorConfig(block_size=4, num_blocks=256, **config), torch.device("cpu"))
    gen.load_weights(model)
    return gen


def test_a_stream_of_one_batch_is_the_generate_call():
    """The same prompts, seed and weights: a stream holding them all from its first pass samples
    exactly what one `generate` call does (tokens and logprobs to the last bit)."""
    gen = _gen(tiny_model(ARGS, 0), decode_steps_per_schedule=4)
    prompts = _prompts([5, 9, 14, 3])
    params = SamplingParams(max_new_tokens=24, temperature=1.0, n=3, seed=11)
    ref, ref_stats = gen.generate(prompts, params)
    feed = Feed(gen, [prompts], 11)
    stats = stream(gen, feed, params)
    got = sorted(feed.done, key=lambda c: (c.prompt_index, c.sample_index))
    assert [(c.token_ids, c.logprobs) for c in got] == [(c.token_ids, c.logprobs) for c in ref]
    assert all(c.versions == [0] * len(c.token_ids) for c in got)
    assert (stats.decode_tokens, stats.decode_steps) == (ref_stats.decode_tokens, ref_stats.decode_steps)
    assert all(rc == 0 for rc in gen.allocator.ref_count)


def test_groups_join_a_stream_that_never_drains():
    """Batches added while others decode: every group completes, blocks all come back."""
    gen = _gen(tiny_model(ARGS, 0), decode_steps_per_schedule=2)
    batches = [_prompts([4, 7], seed=s) for s in range(4)]
    feed = Feed(gen, batches, 5, all_at_once=False)
    stream(gen, feed, SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=5))
    assert sorted((c.prompt_index, c.sample_index) for c in feed.done) == [(i, j) for i in range(8) for j in range(2)]
    assert all(rc == 0 for rc in gen.allocator.ref_count)


def _swap_run(new_model, recompute):
    old = tiny_model(ARGS, 0)
    gen = _gen(old, decode_steps_per_schedule=1)
    prompts = _prompts([6, 11, 4])
    feed = Feed(gen, [prompts], 3, new_model=new_model, swap_after=5, recompute=recompute, all_at_once=True)
    stream(gen, feed, SamplingParams(max_new_tokens=30, temperature=1.0, n=2, seed=3))
    return old, prompts, feed.done


def _check_versions(old, new, prompts, done):
    crossed = 0
    for c in done:
        assert c.versions is not None and len(c.versions) == len(c.token_ids)
        assert c.versions == sorted(c.versions)  # version 0 tokens, then version 1 tokens
        ref = {v: _teacher_forced(m, prompts[c.prompt_index], c.token_ids) for v, m in ((0, old), (1, new))}
        for t, v in enumerate(c.versions):
            assert abs(c.logprobs[t] - ref[v][t]) < TOL, (c.prompt_index, c.sample_index, t, v)
        crossed += 0 in c.versions and 1 in c.versions
    assert crossed > 0, "no sample was decoding at the swap"


def test_weights_swapped_mid_decode_keep_the_kv_and_stamp_each_token():
    """The new weights differ in the final norm only, so the K/V of earlier tokens is the same
    under both versions: tokens before the swap are scored by the old policy, those after it by
    the new one, each matching a full forward of its version, in the same samples."""
    new = tiny_model(ARGS, 0)
    with torch.no_grad():
        new.norm.weight.mul_(1.7).add_(0.05)  # the output is tied to the embedding: not that
    old, prompts, done = _swap_run(new, recompute=False)
    _check_versions(old, new, prompts, done)


def test_a_swap_with_recompute_rebuilds_the_kv_under_the_new_weights():
    """Every weight differs; with rollout.recompute_kv the samples in flight are prefilled again
    under the new weights, so tokens after the swap match a full forward of the new model."""
    new = tiny_model(ARGS, 1)
    old, prompts, done = _swap_run(new, recompute=True)
    _check_versions(old, new, prompts, done)


def test_without_recompute_tokens_after_a_full_swap_see_the_old_kv():
    """The check above can fail: every weight differs and the KV is kept, so tokens after the
    swap do not match a full forward of the new model (their context's K/V is the old one's)."""
    new = tiny_model(ARGS, 1)
    old, prompts, done = _swap_run(new, recompute=False)
    with pytest.raises(AssertionError):
        _check_versions(old, new, prompts, done)
