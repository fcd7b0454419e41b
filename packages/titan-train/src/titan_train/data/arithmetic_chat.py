"""A chat-format set generated on the spot (`data.source arithmetic_chat`): conversations asking for sums,
differences and products of small numbers, answered in one line. Needs no download and is the same
everywhere; the SFT recipe fine-tunes on it."""
from __future__ import annotations

import random

SIZE = 4096
QUESTIONS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?", "Please work out {a} {op} {b}.")
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ArithmeticChat:
    """SIZE conversations; conversation i depends on i alone (random access, like every other source)."""

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> list[dict[str, str]]:
        if not 0 <= index < SIZE:
            raise IndexError(index)
        rng = random.Random(index)
        op = rng.choice(sorted(OPERATIONS))
        a, b = rng.randint(0, 99), rng.randint(0, 99 if op != "*" else 12)
        question = rng.choice(QUESTIONS).format(a=a, op=op, b=b)
        messages = [{"role": "user", "content": question},
                    {"role": "assistant", "content": f"{a} {op} {b} = {OPERATIONS[op](a, b)}."}]
        if index % 4 == 0:
            messages.insert(0, {"role": "system", "content": "You are a careful calculator."})
        return messages
