"""The next round's prompt (mempo/next_prompt.py), one rule for rollouts and SFT."""

from __future__ import annotations

from typing import Any

from mempo.agent_format import Tags, first_prompt_ids, parse_response
from mempo.next_prompt import next_prompt_ids
from mempo.schemas import Round

TAGS = Tags(information="docs")
RESPONSE = "<mem>Q1: ?</mem>\n<think>look it up</think>\n<search>Zorvan Kelt</search>"


def _played(tok: Any, questions: list[str]) -> Round:
    response = tok.encode(RESPONSE, add_special_tokens=False)
    return Round.model_validate(
        {
            "index": 0,
            "prompt_ids": first_prompt_ids(tok, questions),
            "response_ids": response,
            "response_logprobs": [0.0] * len(response),
            "action": "search",
            "query": "Zorvan Kelt",
            "information": "Doc 1(Title: Zorvan Kelt) was born in Mirath.",
        }
    )


def test_memory_mode_renders_the_task_and_this_round_with_the_given_tags(tokenizer: Any) -> None:
    questions = ["Where was Zorvan Kelt born?"]
    played = _played(tokenizer, questions)
    ids = next_prompt_ids(tokenizer, questions, played, parse_response(RESPONSE, TAGS), True, TAGS)
    text = tokenizer.decode(ids)
    tail = text[text.rfind("Question: ") :]
    assert "<mem>Q1: ?</mem>\n<search> Zorvan Kelt</search>" in tail
    assert "<docs>Doc 1(Title: Zorvan Kelt) was born in Mirath.</docs>" in tail
    assert "<information>" not in tail


def test_full_mode_appends_the_response_and_the_information_ids(tokenizer: Any) -> None:
    questions = ["Where was Zorvan Kelt born?"]
    played = _played(tokenizer, questions)
    ids = next_prompt_ids(tokenizer, questions, played, parse_response(RESPONSE, TAGS), False, TAGS)
    head = [*played.prompt_ids.tolist(), *played.response_ids.tolist()]
    assert ids[: len(head)] == head
    info = tokenizer.decode(ids[len(head) :])
    assert info == "\n\n<docs>Doc 1(Title: Zorvan Kelt) was born in Mirath.</docs>\n\n"
