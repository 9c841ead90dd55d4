"""Chat data the tests generate (no data is shipped): a ChatML-style template for the byte
tokenizer and ``.jsonl`` conversations of random lengths, some multi-turn."""

from __future__ import annotations

import json
import random
from pathlib import Path

CHATML = ("{% for m in messages %}"
          "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = ["sum", "list", "value", "print", "loop", "add", "two", "three", "yes", "no", "why"]


def conversation(rng: random.Random) -> dict:
    """One conversation: a system prompt, then 1-3 user / assistant exchanges."""
    words = lambda low, high: " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))  # noqa: E731
    messages = [{"role": "system", "content": "You are " + words(1, 4) + "."}]
    for _ in range(rng.randint(1, 3)):
        messages += [{"role": "user", "content": words(1, 8) + "?"},
                     {"role": "assistant", "content": words(1, 10) + "."}]
    return {"messages": messages}


def write_chat_jsonl(path: Path, rows: int = 300, seed: int = 0) -> str:
    """``rows`` random conversations written to ``path``; returns its path as a string."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(rows):
            handle.write(json.dumps(conversation(rng)) + "\n")
    return str(path)


def chat_settings(path: str) -> tuple[str, ...]:
    """``--set`` overrides that train on the chat ``.jsonl`` at ``path`` with :data:`CHATML`."""
    return (f"data.source={path}", "data.format=chat", f"data.chat_template={CHATML}")
