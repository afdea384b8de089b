"""Workloads of independent requests: llm-d's prefix groups and vLLM's benchmark datasets.

Nothing is resent and answers are not kept, so every request is rendered up front.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from loadgen.workloads.base import (
    ChatMessage,
    PlannedRequest,
    TimedRequest,
    poisson_arrivals,
    seeded_rng,
    segment_tokens,
)
from loadgen.workloads.chat_text import WORD_PER_ID, Lexicon


class IndependentWorkload:
    """Workloads of independent requests: nothing is resent, answers are not kept."""

    name = "stateless"

    def __init__(self, seed: int, chat_text: bool = False,
                 lexicon: Lexicon = WORD_PER_ID) -> None:
        self.seed = seed
        self.chat_text = chat_text
        self.lexicon = lexicon
        self._requests: list[TimedRequest] = []

    def plan(self) -> list[PlannedRequest]:
        return [
            PlannedRequest(r.index, r.conversation_id, r.turn, r.arrival) for r in self._requests
        ]

    def render(self, planned: PlannedRequest, at: float = 0.0) -> TimedRequest:
        req = self._requests[planned.index]
        if not self.chat_text:
            return req
        return replace(req, messages=self.chat_messages(req))

    def chat_messages(self, req: TimedRequest) -> tuple[ChatMessage, ...]:
        """The prompt as one user message (workloads with a shared prefix split it off)."""
        return (ChatMessage("user", self.lexicon.text(req.prompt_token_ids)),)

    def record_answer(self, planned: PlannedRequest, answer: Sequence[int],
                      text: str | None = None) -> None:
        """Independent requests: nothing to continue."""

    @property
    def rendered(self) -> list[TimedRequest]:
        """Every request, rendered (they do not depend on answers)."""
        return list(self._requests)


class GroupsWorkload(IndependentWorkload):
    """llm-d's prefix-group benchmark: G groups x U users, group prefix + user question.

    Each of the G*U users has one fixed prompt (its group's S-token prefix, then its own
    Q-token question); requests pick a user uniformly at random and arrive by a Poisson
    process whose rate steps up (`rates`, `stage_seconds`).
    """

    name = "groups"

    def __init__(
        self,
        *,
        groups: int = 150,
        users: int = 5,
        prefix_tokens: int = 6000,
        question_tokens: int = 1200,
        output_tokens: int = 1000,
        requests: int = 1000,
        rates: Sequence[float] = (5.0,),
        stage_seconds: float = 60.0,
        seed: int = 0,
        chat_text: bool = False,
        lexicon: Lexicon = WORD_PER_ID,
    ) -> None:
        super().__init__(seed, chat_text, lexicon)
        self.groups, self.users = groups, users
        self.prefix_tokens, self.question_tokens = prefix_tokens, question_tokens
        self.output_tokens = output_tokens
        self.rates, self.stage_seconds = tuple(rates), stage_seconds
        arrivals = poisson_arrivals(seed, "groups", rates, stage_seconds, requests)
        picks = seeded_rng(seed, "groups/pick").integers(0, groups * users, size=requests)
        for i, (pick, at) in enumerate(zip(picks, arrivals, strict=True)):
            g, u = divmod(int(pick), users)
            prompt = segment_tokens(seed, f"groups/prefix/{g}", prefix_tokens) + segment_tokens(
                seed, f"groups/question/{g}/{u}", question_tokens
            )
            self._requests.append(TimedRequest(
                index=i, request_id=f"req-{i}", conversation_id=f"group-{g}-user-{u}", turn=0,
                arrival=at, prompt_token_ids=prompt, max_tokens=output_tokens,
            ))

    def chat_messages(self, req: TimedRequest) -> tuple[ChatMessage, ...]:
        """The group's prefix as the system prompt, the user's question as its message."""
        prompt = req.prompt_token_ids
        return (ChatMessage("system", self.lexicon.text(prompt[:self.prefix_tokens])),
                ChatMessage("user", self.lexicon.text(prompt[self.prefix_tokens:])))

    def describe(self) -> dict[str, object]:
        return {
            "workload": self.name, "groups": self.groups, "users": self.users,
            "prefix_tokens": self.prefix_tokens, "question_tokens": self.question_tokens,
            "output_tokens": self.output_tokens, "requests": len(self._requests),
            "rates": list(self.rates), "stage_seconds": self.stage_seconds, "seed": self.seed,
        }


class PrefixRepetitionWorkload(IndependentWorkload):
    """vLLM's prefix_repetition dataset: P prefixes, each request one of them + a fresh suffix."""

    name = "prefix-repetition"

    def __init__(
        self,
        *,
        requests: int = 100,
        num_prefixes: int = 10,
        prefix_tokens: int = 256,
        suffix_tokens: int = 256,
        output_tokens: int = 128,
        seed: int = 0,
        chat_text: bool = False,
        lexicon: Lexicon = WORD_PER_ID,
    ) -> None:
        super().__init__(seed, chat_text, lexicon)
        self.num_prefixes, self.prefix_tokens = num_prefixes, prefix_tokens
        self.suffix_tokens, self.output_tokens = suffix_tokens, output_tokens
        picks = seeded_rng(seed, "prefix-repetition/pick").integers(0, num_prefixes, size=requests)
        for i, p in enumerate(picks):
            prompt = segment_tokens(seed, f"prefix-repetition/prefix/{int(p)}", prefix_tokens)
            prompt += segment_tokens(seed, f"prefix-repetition/suffix/{i}", suffix_tokens)
            self._requests.append(TimedRequest(
                index=i, request_id=f"req-{i}", conversation_id=f"prefix-{int(p)}", turn=0,
                arrival=None, prompt_token_ids=prompt, max_tokens=output_tokens,
            ))

    def describe(self) -> dict[str, object]:
        return {
            "workload": self.name, "requests": len(self._requests),
            "num_prefixes": self.num_prefixes, "prefix_tokens": self.prefix_tokens,
            "suffix_tokens": self.suffix_tokens, "output_tokens": self.output_tokens,
            "seed": self.seed,
        }


class RandomWorkload(IndependentWorkload):
    """vLLM's random dataset: lengths uniform in [len*(1-r), len*(1+r)], optional shared prefix."""

    name = "random"

    def __init__(
        self,
        *,
        requests: int = 100,
        input_tokens: int = 1024,
        output_tokens: int = 128,
        range_ratio: float = 0.0,
        prefix_tokens: int = 0,
        seed: int = 0,
        chat_text: bool = False,
        lexicon: Lexicon = WORD_PER_ID,
    ) -> None:
        super().__init__(seed, chat_text, lexicon)
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError("range_ratio must be in [0, 1)")
        self.input_tokens, self.output_tokens = input_tokens, output_tokens
        self.range_ratio, self.prefix_tokens = range_ratio, prefix_tokens
        rng = seeded_rng(seed, "random/lengths")
        shared = segment_tokens(seed, "random/prefix", prefix_tokens)
        for i in range(requests):
            n_in = int(rng.integers(
                math.floor(input_tokens * (1 - range_ratio)),
                math.ceil(input_tokens * (1 + range_ratio)) + 1,
            ))
            n_out = int(rng.integers(
                max(1, math.floor(output_tokens * (1 - range_ratio))),
                math.ceil(output_tokens * (1 + range_ratio)) + 1,
            ))
            self._requests.append(TimedRequest(
                index=i, request_id=f"req-{i}", conversation_id=f"random-{i}", turn=0,
                arrival=None,
                prompt_token_ids=shared + segment_tokens(seed, f"random/{i}", n_in),
                max_tokens=n_out,
            ))

    def describe(self) -> dict[str, object]:
        return {
            "workload": self.name, "requests": len(self._requests),
            "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
            "range_ratio": self.range_ratio, "prefix_tokens": self.prefix_tokens,
            "seed": self.seed,
        }
