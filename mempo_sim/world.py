"""A synthetic multi-hop QA world, generated deterministically from a seed.

Fictional people, cities, countries and organisations, each named by one word of the
shared name pool (mempo_sim/lexicon.py); one wiki-18 style passage per entity
(``{"id", "contents": "Title\\nbody"}``, the title unquoted so that every mention of a
name is the same token); 1-hop and 2-hop questions whose answers are other entities'
names (years only with ``WorldConfig.year_questions``), so an agent cannot guess them
and must search; k-question tasks that force it to remember earlier findings; a
train/test split by subject entity (no question is shared); and an oracle policy
(mempo_sim/oracle.py) that writes the ideal rounds given what retrieval returns.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from mempo_sim.lexicon import BACKGROUND, FILL, NAMES, ORG_KINDS, PROFESSIONS

Split = Literal["train", "test"]

@dataclass(frozen=True)
class Relation:
    """One attribute edge: subject kind -> object kind, as a question and a sentence."""

    name: str
    subject: str  # person | city | org | country
    phrase: str  # "the birth city of X", used in thoughts
    keyword: str  # extra search word for a second attempt
    question: str  # template with {s}
    pattern: str  # regex with {s}; group 1 is the value


RELATIONS: dict[str, Relation] = {
    r.name: r
    for r in [
        Relation(
            "birthplace",
            "person",
            "birth city",
            "born",
            "In which city was {s} born?",
            r"\b{s} was born in \d+ in the city of ([A-Z]\w*)\.",
        ),
        Relation(
            "birth_year",
            "person",
            "birth year",
            "born",
            "In what year was {s} born?",
            r"\b{s} was born in (\d+) ",
        ),
        Relation(
            "employer",
            "person",
            "employer",
            "works",
            "Which organization does {s} work for?",
            r"\b{s} is an? \w+ and works for ([A-Z]\w*)\.",
        ),
        Relation(
            "country",
            "city",
            "country",
            "country",
            "In which country is the city of {s}?",
            r"\b{s} is a city in ([A-Z]\w*), founded",
        ),
        Relation(
            "city_founded",
            "city",
            "founding year",
            "founded",
            "In what year was the city of {s} founded?",
            r"\b{s} is a city in \w+, founded in (\d+)\.",
        ),
        Relation(
            "headquarters",
            "org",
            "headquarters city",
            "headquartered",
            "In which city is {s} headquartered?",
            r"\b{s} is an? \w+ headquartered in ([A-Z]\w*)\.",
        ),
        Relation(
            "founder",
            "org",
            "founder",
            "founded",
            "Who founded {s}?",
            r"\b{s} is an? \w+ headquartered in \w+\. It was founded in \d+ by ([A-Z]\w*)\.",
        ),
        Relation(
            "org_founded",
            "org",
            "founding year",
            "founded",
            "In what year was {s} founded?",
            r"\b{s} is an? \w+ headquartered in \w+\. It was founded in (\d+) by",
        ),
        Relation(
            "capital",
            "country",
            "capital",
            "capital",
            "What is the capital of {s}?",
            r"\b{s} is a country whose capital is ([A-Z]\w*)\.",
        ),
    ]
}

YEAR_RELATIONS = tuple(name for name in RELATIONS if name.endswith(("_year", "_founded")))
NAME_RELATIONS = tuple(name for name in RELATIONS if name not in YEAR_RELATIONS)

# Two-hop questions: (first relation, second relation, template with {s}).
TWO_HOP: dict[str, tuple[str, str, str]] = {
    "birth_country": ("birthplace", "country", "In which country was {s} born?"),
    "employer_hq": (
        "employer",
        "headquarters",
        "In which city is the employer of {s} headquartered?",
    ),
    "founder_birthplace": ("founder", "birthplace", "In which city was the founder of {s} born?"),
    "hq_country": ("headquarters", "country", "In which country is {s} headquartered?"),
}


@dataclass(frozen=True)
class Question:
    """A question, its chain of relations from the subject, and its gold aliases."""

    text: str
    subject: str
    relations: tuple[str, ...]
    answers: tuple[str, ...]
    split: Split

    @property
    def hops(self) -> int:
        return len(self.relations)


@dataclass(frozen=True)
class WorldConfig:
    seed: int = 0
    people: int = 80  # 126 entities: about half of the shared name pool
    cities: int = 20
    countries: int = 6
    orgs: int = 20
    max_hops: int = 2
    test_fraction: float = 0.2
    background: int = 1  # background sentences per passage (0: facts only; 7: ~90 words)
    year_questions: bool = False  # also ask the years the passages state
    relations: tuple[str, ...] = NAME_RELATIONS  # 1-hop questions (years added by year_questions)
    two_hop: tuple[str, ...] = tuple(TWO_HOP)

    def asked(self) -> tuple[str, ...]:
        """The 1-hop relations questions are asked about."""
        return self.relations + (YEAR_RELATIONS if self.year_questions else ())


@dataclass
class World:
    """The generated world. Build with ``World.generate(WorldConfig(...))``."""

    config: WorldConfig
    facts: dict[str, dict[str, str]]  # entity name -> relation name -> value
    kinds: dict[str, str]  # entity name -> person | city | org | country
    passages: list[dict[str, str]]
    questions: list[Question]

    # ----------------------------------------------------------------- generation

    @classmethod
    def generate(cls, config: WorldConfig | None = None) -> World:
        config = config or WorldConfig()
        rng = random.Random(config.seed)
        counts = (config.countries, config.cities, config.orgs, config.people)
        if sum(counts) > len(NAMES):
            raise ValueError(f"a world of {sum(counts)} entities needs more than the {len(NAMES)} pool names")
        names = iter(rng.sample(NAMES, sum(counts)))  # without replacement
        countries, cities, orgs, people = ([next(names) for _ in range(n)] for n in counts)
        facts: dict[str, dict[str, str]] = {}
        kinds: dict[str, str] = {}
        for c in countries:
            kinds[c] = "country"
        for i, c in enumerate(countries):  # every country gets a capital among the cities
            facts[c] = {"capital": cities[i % len(cities)]}
        for c in cities:
            kinds[c] = "city"
            facts[c] = {
                "country": rng.choice(countries),
                "city_founded": str(rng.randint(900, 1800)),
            }
        for i, c in enumerate(countries):
            facts[cities[i % len(cities)]]["country"] = c  # a capital lies in its country
        for p in people:
            kinds[p] = "person"
            facts[p] = {
                "birthplace": rng.choice(cities),
                "birth_year": str(rng.randint(1800, 1999)),
                "employer": rng.choice(orgs),
                "profession": rng.choice(PROFESSIONS),
            }
        for o in orgs:
            kinds[o] = "org"
            facts[o] = {
                "headquarters": rng.choice(cities),
                "founder": rng.choice(people),
                "org_founded": str(rng.randint(1700, 1990)),
                "kind": rng.choice(ORG_KINDS),
            }
        world = cls(config=config, facts=facts, kinds=kinds, passages=[], questions=[])
        world.passages = [world._passage(i, name) for i, name in enumerate(kinds)]
        world.questions = world._make_questions(rng)
        return world

    def _passage(self, index: int, name: str) -> dict[str, str]:
        f, kind = self.facts[name], self.kinds[name]
        if kind == "person":
            body = (
                f"{name} was born in {f['birth_year']} in the city of {f['birthplace']}. "
                f"{name} is {_article(f['profession'])} and works for {f['employer']}."
            )
        elif kind == "city":
            body = f"{name} is a city in {f['country']}, founded in {f['city_founded']}."
        elif kind == "org":
            body = (
                f"{name} is {_article(f['kind'])} headquartered in {f['headquarters']}. "
                f"It was founded in {f['org_founded']} by {f['founder']}."
            )
        else:
            body = f"{name} is a country whose capital is {f['capital']}."
        body = " ".join([body, *self._background(name, kind)])
        return {"id": str(index), "contents": f"{name}\n{body}"}

    def _background(self, name: str, kind: str) -> list[str]:
        rng = random.Random(f"{self.config.seed}:background:{name}")
        pool = BACKGROUND[kind]
        chosen = rng.sample(pool, min(self.config.background, len(pool)))
        fill = {key: rng.sample(words, 2) for key, words in FILL.items()}
        values = {k: v[0] for k, v in fill.items()} | {f"{k}2": v[1] for k, v in fill.items()}
        return [template.format(name=name, **values) for template in chosen]

    def _make_questions(self, rng: random.Random) -> list[Question]:
        cfg = self.config
        subjects = sorted(self.kinds)
        test_subjects = {s for s in subjects if rng.random() < cfg.test_fraction}
        questions: list[Question] = []
        for subject in subjects:
            split: Split = "test" if subject in test_subjects else "train"
            kind = self.kinds[subject]
            for rel_name in cfg.asked():
                rel = RELATIONS[rel_name]
                if rel.subject == kind:
                    value = self.facts[subject][rel_name]
                    questions.append(
                        Question(
                            rel.question.format(s=subject),
                            subject,
                            (rel_name,),
                            (value,),
                            split,
                        )
                    )
            if cfg.max_hops < 2:
                continue
            for two_name in cfg.two_hop:
                first, second, template = TWO_HOP[two_name]
                if RELATIONS[first].subject != kind:
                    continue
                middle = self.facts[subject][first]
                value = self.facts[middle][second]
                questions.append(
                    Question(
                        template.format(s=subject),
                        subject,
                        (first, second),
                        (value,),
                        split,
                    )
                )
        return questions

    # ----------------------------------------------------------------- queries

    def split_questions(self, split: Split, max_hops: int | None = None) -> list[Question]:
        return [
            q
            for q in self.questions
            if q.split == split and (max_hops is None or q.hops <= max_hops)
        ]

    def question(self, text: str) -> Question | None:
        return self._by_text().get(text.strip())

    def _by_text(self) -> dict[str, Question]:
        cache = getattr(self, "_question_index", None)
        if cache is None:
            cache = {q.text: q for q in self.questions}
            self._question_index = cache
        return cache

    def tasks(
        self, split: Split, k: int, count: int, seed: int = 0, max_hops: int | None = None
    ) -> list[tuple[list[str], list[list[str]]]]:
        """``count`` tasks of ``k`` questions with distinct subjects: (questions, aliases)."""
        pool = self.split_questions(split, max_hops)
        if len({q.subject for q in pool}) < k:
            raise ValueError(f"the {split} split has fewer than {k} distinct subjects")
        rng = random.Random(f"{self.config.seed}:{split}:{k}:{seed}")
        out = []
        for _ in range(count):
            chosen: list[Question] = []
            while len(chosen) < k:
                q = rng.choice(pool)
                if all(q.subject != c.subject for c in chosen):
                    chosen.append(q)
            out.append(([q.text for q in chosen], [list(q.answers) for q in chosen]))
        return out

    def iter_corpus(self) -> Iterator[dict[str, str]]:
        yield from self.passages

    def extract(self, relation: str, subject: str, information: str) -> str | None:
        """Read ``relation`` of ``subject`` from retrieved text, or None if it is not there."""
        pattern = RELATIONS[relation].pattern.format(s=re.escape(subject))
        match = re.search(pattern, information)
        return match.group(1).strip() if match else None


def _article(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"
