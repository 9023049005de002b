"""Agent format: parsing rules, render -> parse round trips, mem token spans, contexts."""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempo.agent_format import (
    DEFAULT_TAGS,
    PreviousRound,
    Tags,
    answer_candidates,
    answer_cue,
    first_prompt_ids,
    format_documents,
    full_next_prompt_ids,
    full_scoring_ids,
    information_ids,
    mem_token_span,
    memory_prompt_ids,
    memory_scoring_ids,
    parse_response,
    round_transcript,
)


class TestParse:
    def test_search_round(self) -> None:
        p = parse_response("<mem>Q1: ?</mem>\n<think>find it</think>\n<search>Zorvan Kelt</search>")
        assert (p.action, p.memory, p.think, p.query) == ("search", "Q1: ?", "find it", "Zorvan Kelt")
        assert p.format_ok and p.error is None

    def test_answer_round_and_mem_chars(self) -> None:
        text = "  <mem>Q1: Mirath</mem><think>done</think><answer> Mirath </answer>\n"
        p = parse_response(text)
        assert (p.action, p.answer) == ("answer", "Mirath")
        assert p.mem_chars is not None and text[p.mem_chars[0] : p.mem_chars[1]] == "Q1: Mirath"

    def test_think_is_optional(self) -> None:
        assert parse_response("<mem>m</mem><search>q</search>").action == "search"

    def test_tool_call_search(self) -> None:
        call = '{"name": "search", "arguments": {"query": "Velmar Guild"}}'
        p = parse_response(f"<mem>m</mem><think>t</think><tool_call>{call}</tool_call>")
        assert (p.action, p.query) == ("search", "Velmar Guild")
        stringly = '{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}'
        assert parse_response(f"<mem>m</mem><tool_call>{stringly}</tool_call>").query == "x"

    @pytest.mark.parametrize(
        "text",
        [
            "",
            "just some text",
            "<mem>m</mem><think>t</think>",  # no action
            "<mem>m<think>t</think></mem><search>q</search>",  # nesting
            "<mem>m</mem><think>t</think><search>q",  # unclosed
            "<mem>m</mem>stray<search>q</search>",  # text between blocks
            "<mem>m</mem><search>q</search> trailing",  # text after the action
            "<think>t</think><mem>m</mem><search>q</search>",  # wrong order
            "<think>t</think><search>q</search>",  # no memory in memory mode
            "<mem>m</mem><search>   </search>",  # empty query
            "<mem>m</mem><answer></answer>",  # empty answer
            "<mem>m</mem><search>a</search><answer>b</answer>",  # two actions
            "<mem>m</mem><information>made up</information><answer>b</answer>",
            '<mem>m</mem><tool_call>{"name": "calc", "arguments": {}}</tool_call>',
            "<mem>m</mem><tool_call>not json</tool_call>",
            "</mem><mem>m</mem><answer>a</answer>",
        ],
    )
    def test_invalid(self, text: str) -> None:
        p = parse_response(text)
        assert p.action == "invalid" and not p.format_ok and p.error

    def test_memory_optional_in_full_mode(self) -> None:
        assert parse_response("<think>t</think><search>q</search>", require_memory=False).action == "search"
        assert parse_response("<answer>a</answer>", require_memory=False).action == "answer"

    def test_custom_tags(self) -> None:
        tags = Tags(mem="memory", search="query")
        p = parse_response("<memory>m</memory><think>t</think><query>q</query>", tags)
        assert (p.action, p.memory, p.query) == ("search", "m", "q")
        assert tags.stop_strings() == ["</query>", "</answer>", "</tool_call>"]

    @settings(max_examples=300, deadline=None)
    @given(st.text())
    def test_never_raises_on_any_text(self, text: str) -> None:
        assert parse_response(text).action in ("search", "answer", "invalid")

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.sampled_from([*DEFAULT_TAGS.all_tags(), "x", " ", "\n", "{", '"query"', "<", ">"]), max_size=12))
    def test_never_raises_on_tag_soup(self, parts: list[str]) -> None:
        p = parse_response("".join(parts))
        if p.action == "search":
            assert p.query
        if p.action == "answer":
            assert p.answer


class TestMemSpan:
    def test_span_is_exactly_the_memory_tokens(self, tokenizer: Any) -> None:
        text = "<mem>Q1: Mirath > Dostania; Q2: ?</mem>\n<think>Q2 needs x.</think>\n<search>Velmar Guild</search>"
        ids = tokenizer.encode(text, add_special_tokens=False)
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        p = parse_response(decoded)
        span = mem_token_span(tokenizer, ids, decoded, p.mem_chars)
        assert span is not None
        start, end = span
        assert tokenizer.decode(ids[start:end]) == "Q1: Mirath > Dostania; Q2: ?"
        assert ids[start - 1] == tokenizer.convert_tokens_to_ids("<mem>")
        assert ids[end] == tokenizer.convert_tokens_to_ids("</mem>")

    @settings(max_examples=40, deadline=None)
    @given(st.text(alphabet="abc xyz<>;é→", min_size=0, max_size=30))
    def test_span_covers_memory_minimally(self, tokenizer: Any, memory: str) -> None:
        # "<memo>" is not one token in the tiny vocabulary: boundaries may straddle tokens.
        tags = Tags(mem="memo")
        text = f"<memo>{memory}</memo><search>q</search>"
        ids = tokenizer.encode(text, add_special_tokens=False)
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        p = parse_response(decoded, tags)
        if p.mem_chars is None:
            return  # the memory itself contained a tag: invalid, no span
        start, end = mem_token_span(tokenizer, ids, decoded, p.mem_chars) or (0, 0)
        covered = tokenizer.decode(ids[start:end])
        assert memory in covered
        if end - start >= 2 and memory:
            assert memory not in tokenizer.decode(ids[start + 1 : end])
            assert memory not in tokenizer.decode(ids[start : end - 1])

    def test_no_memory_no_span(self, tokenizer: Any) -> None:
        assert mem_token_span(tokenizer, [1, 2], "ab", None) is None

    def test_empty_memory(self, tokenizer: Any) -> None:
        text = "<mem></mem><answer>a</answer>"
        ids = tokenizer.encode(text, add_special_tokens=False)
        p = parse_response(tokenizer.decode(ids))
        assert mem_token_span(tokenizer, ids, tokenizer.decode(ids), p.mem_chars) == (1, 1)


class TestPrompts:
    questions: ClassVar[list[str]] = ["In which city was Zorvan Kelt born?", "Who founded Velmar Guild?"]

    def test_memory_prompt_holds_only_the_previous_round(self, tokenizer: Any) -> None:
        prev = PreviousRound(memory="Q1: Mirath; Q2: ?", query="Velmar Guild", information='Doc 1(Title: "V") body')
        text = tokenizer.decode(memory_prompt_ids(tokenizer, self.questions, prev))
        assert "Question: In which city was Zorvan Kelt born?; Who founded Velmar Guild?" in text
        assert "<mem>Q1: Mirath; Q2: ?</mem>" in text
        assert "<search> Velmar Guild</search>" in text
        assert '<information>Doc 1(Title: "V") body</information>' in text
        assert text.endswith("<|im_start|>assistant\n")
        first = tokenizer.decode(memory_prompt_ids(tokenizer, self.questions, None))
        assert first == tokenizer.decode(first_prompt_ids(tokenizer, self.questions))
        assert "<information>" not in first.split("Question:")[1]

    def test_full_mode_appends_ids(self, tokenizer: Any) -> None:
        p1 = first_prompt_ids(tokenizer, self.questions)
        r1 = tokenizer.encode("<think>t</think><search>q</search>", add_special_tokens=False)
        info = information_ids(tokenizer, "Doc 1(Title: x) y")
        p2 = full_next_prompt_ids(p1, r1, info)
        assert p2[: len(p1)] == p1 and p2[len(p1) : len(p1) + len(r1)] == r1 and p2[len(p1) + len(r1) :] == info
        assert tokenizer.decode(info) == "\n\n<information>Doc 1(Title: x) y</information>\n\n"

    def test_plain_layout_without_chat_template(self, tokenizer: Any) -> None:
        class NoTemplate:
            chat_template = None

            def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
                return list(text.encode())

        ids = first_prompt_ids(NoTemplate(), ["q?"])  # type: ignore[arg-type]
        text = bytes(ids).decode()
        assert text.startswith("System: ") and "User: Question: q?" in text and text.endswith("Assistant: ")

    def test_scoring_contexts_extend_each_other(self, tokenizer: Any) -> None:
        transcripts = [
            round_transcript("<mem>a</mem><search>x</search>", "Doc 1(Title: t) b"),
            round_transcript("<mem>c</mem><search>y</search>", "Doc 1(Title: u) d"),
        ]
        cue = tokenizer.encode(answer_cue(), add_special_tokens=False)
        contexts = [full_scoring_ids(tokenizer, self.questions, transcripts[:t]) for t in range(3)]
        for shorter, longer in itertools.pairwise(contexts):
            body = shorter[: -len(cue)]
            assert longer[: len(body)] == body and longer[-len(cue) :] == cue
        assert contexts[0] == first_prompt_ids(tokenizer, self.questions) + cue
        mem = tokenizer.decode(memory_scoring_ids(tokenizer, self.questions, "Q1: a"))
        assert mem.endswith("<|im_start|>assistant\n<mem>Q1: a</mem>\n<think>All questions are answered.</think>\n<answer>")


def test_format_documents_like_search_r1() -> None:
    docs = [
        {"document": {"id": "1", "contents": '"Zorvan Kelt"\nZorvan Kelt was born in Mirath.'}, "score": 3.2},
        {"id": "2", "contents": '"Mirath"\nMirath is a city.\nSecond line.'},
    ]
    assert format_documents(docs) == (
        'Doc 1(Title: "Zorvan Kelt") Zorvan Kelt was born in Mirath.\n'
        'Doc 2(Title: "Mirath") Mirath is a city.\nSecond line.'
    )
    assert format_documents([]) == ""


def test_answer_candidates() -> None:
    gold = [["Velmar Guild", "Velmar"], ["1854"], ["Mirath", "Mirath City", "Old Mirath"]]
    assert answer_candidates(gold, "first") == ["Velmar Guild; 1854; Mirath"]
    assert answer_candidates(gold) == ["Velmar Guild; 1854; Mirath", "Velmar; 1854; Mirath City", "Velmar; 1854; Old Mirath"]
    assert answer_candidates([["a", "a"]]) == ["a"]
    with pytest.raises(ValueError):
        answer_candidates([[]])
