"""Key-value retrieval over a long context: find the value of one key among thousands of distractor pairs.

The prompt is `context_chars` characters of lines `KEY=VALUE` (4-letter keys, 3-digit values, every key
distinct) and ends with the query `?KEY=`; the answer is that key's value. One character is one token
under the byte tokenizer, so `context_chars` is the context length in tokens (4k-16k for long-context
training). The queried pair sits anywhere in the context, uniformly, so the policy must attend across
all of it. Reward: 1.0 for the exact value, else the fraction of its digits in the right place (a dense
signal for small policies).
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass

from titan_rl.envs.base import Problem, first_line

_LINE_CHARS = len("abcd=123\n")


@dataclass(kw_only=True, frozen=True)
class KeyValueRetrievalTask:
    context_chars: int = 4096
    """Length of the key-value context (characters = byte tokens), query excluded."""

    def __post_init__(self) -> None:
        if self.context_chars < 2 * _LINE_CHARS:
            raise ValueError(f"context_chars={self.context_chars}; must hold at least two pairs ({2 * _LINE_CHARS})")

    def sample(self, rng: random.Random) -> Problem:
        pairs = self.context_chars // _LINE_CHARS
        keys: set[str] = set()
        while len(keys) < pairs:
            keys.add("".join(rng.choices(string.ascii_lowercase, k=4)))
        ordered = sorted(keys)
        rng.shuffle(ordered)
        values = [f"{rng.randrange(1000):03d}" for _ in ordered]
        target = rng.randrange(pairs)
        context = "".join(f"{k}={v}\n" for k, v in zip(ordered, values))
        return Problem(prompt=f"{context}?{ordered[target]}=", answer=values[target])

    def reward(self, problem: Problem, completion: str) -> float:
        got, want = first_line(completion), problem.answer
        if got == want:
            return 1.0
        return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want))
