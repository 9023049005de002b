"""The words the synthetic world (mempo/world.py) is written with.

Invented names are made of ``SYLLABLES``; the tiny model's tokenizer (mempo/tiny.py)
learns the syllables rather than whole names (``name_syllables`` splits one back), so a
held-out name is still spelled with tokens the policy was trained to write. The rest is
the vocabulary of professions, organisations and background sentences.
"""

from __future__ import annotations

import random

SYLLABLES = [
    "ka",
    "ri",
    "zor",
    "van",
    "mel",
    "dro",
    "thi",
    "sel",
    "ul",
    "bar",
    "nek",
    "osk",
    "fen",
    "qua",
    "lor",
    "mi",
    "tas",
    "ven",
    "gra",
    "hol",
    "pir",
    "ed",
    "yun",
    "cal",
    "dex",
    "ro",
    "sa",
    "tum",
    "lek",
    "viv",
    "aur",
    "bo",
    "nim",
    "har",
    "sut",
    "kel",
    "ost",
    "wen",
    "ja",
    "fir",
]


class NameMaker:
    """Capitalised invented words, each used once in the whole world (no collisions)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def word(self, syllables: int) -> str:
        for attempt in range(1000):
            n = syllables + attempt // 50  # grow the word when the short ones run out
            word = "".join(self.rng.choice(SYLLABLES) for _ in range(n)).capitalize()
            if word not in self.used and word.lower() not in COMMON_WORDS:
                self.used.add(word)
                return word
        raise RuntimeError("name space exhausted")


COMMON_WORDS = {
    "a",
    "an",
    "the",
    "is",
    "in",
    "it",
    "of",
    "by",
    "and",
    "for",
    "was",
    "born",
    "city",
}


# Longest first, so a name splits into whole syllables; "ia" ends country names.
NAME_PIECES = sorted({*SYLLABLES, "ia"}, key=lambda p: (-len(p), p))


def name_syllables(word: str) -> list[str] | None:
    """An invented name word split into the syllables it was made of ("Holbar" ->
    ["Hol", "bar"]); None for a word that is not made of them. The tiny model's tokenizer
    learns these pieces instead of whole names."""
    lower = word.lower()
    split: list[list[str] | None] = [[]] + [None] * len(lower)  # split[i]: pieces of lower[:i]
    for i in range(len(lower)):
        if split[i] is None:
            continue
        for piece in NAME_PIECES:
            if lower.startswith(piece, i) and split[i + len(piece)] is None:
                split[i + len(piece)] = [*split[i], piece]  # type: ignore[misc]
    pieces = split[len(lower)]
    if not pieces:
        return None
    out, start = [], 0
    for piece in pieces:  # back to the word's own capitalisation
        out.append(word[start : start + len(piece)])
        start += len(piece)
    return out


PROFESSIONS = [
    "painter",
    "engineer",
    "botanist",
    "sailor",
    "weaver",
    "chemist",
    "poet",
    "mason",
    "judge",
    "baker",
]
ORG_KINDS = [
    "Guild",
    "Institute",
    "Company",
    "Society",
    "Academy",
    "Foundry",
    "Bank",
    "Observatory",
]
RIVER_SUFFIX = "River"

# Background sentences: true of the passage's entity but never asked about. They make
# passages as long as real encyclopedia passages (and the search results as costly to
# carry), and give a reader text to skip. They name no other entity and avoid the words
# that questions use (city, country, born, works, founded, headquartered, capital).
FILL = {
    "topic": ["old maps", "river trade", "glass making", "folk songs", "tidal patterns", "bell casting", "salt roads", "winter birds", "clockwork", "star charts", "dye plants", "harbour law", "paper mills", "mountain passes", "wool prices"],
    "thing": ["copper coins", "pressed flowers", "old keys", "sea shells", "clay whistles", "travel journals", "brass buttons"],
    "instrument": ["cello", "flute", "lute", "harp", "drum", "violin", "horn"],
    "trait": ["patient", "curious", "stubborn", "generous", "careful", "restless", "cheerful", "quiet"],
    "feature": ["stone bridges", "covered markets", "rose gardens", "narrow lanes", "tall towers", "busy docks", "painted gates"],
    "season": ["spring", "summer", "autumn", "winter"],
    "industry": ["weaving", "shipbuilding", "printing", "farming", "mining", "brewing", "pottery"],
}
BACKGROUND = {
    "person": [
        "In spare hours, {first} collects {thing} and plays the {instrument}.",
        "Friends describe {first} as {trait} and {trait2}.",
        "{first} spent several years studying {topic}.",
        "{first} once wrote a long essay about {topic2}.",
        "As a child, {first} lived near a workshop that made {thing2}.",
        "In the evenings {first} teaches a small class on {topic} to neighbours.",
        "Colleagues remember {first} for a {trait} manner and a fondness for {thing}.",
        "Each {season}, {first} travels to see the {feature} of distant towns.",
    ],
    "city": [
        "It is known for its {feature} and its {feature2}.",
        "Every {season} a fair about {topic} is held there.",
        "Many residents earn their living in {industry}.",
        "Visitors come to see its {feature2} and to learn about {topic2}.",
        "Its oldest library holds records of {topic} going back many generations.",
        "Local craftsmen are proud of their {thing} and sell them at the {season} market.",
        "Its council meets in a hall beside the {feature}.",
        "Children there learn {instrument} music from an early age.",
    ],
    "org": [
        "Its members meet every {season} to discuss {topic}.",
        "It publishes a yearly report on {topic2}.",
        "It keeps a small collection of {thing}.",
        "Its first members came from {industry}.",
        "New members are asked to write a short study of {topic2}.",
        "Its offices are decorated with {thing2} given by former members.",
        "Every {season2} it awards a small prize for studies of {topic}.",
        "Its archive contains letters about {industry} and {topic2}.",
    ],
    "country": [
        "It is famous for its {feature} and its {industry}.",
        "Its people celebrate the end of {season} with songs about {topic}.",
        "Its museums hold large collections of {thing}.",
        "Its schools teach {instrument} and the history of {topic2}.",
        "Travellers praise its {feature2} and its {trait} people.",
        "Its oldest laws concern {topic} and the {season} harvest.",
        "Its coins show images of {thing2}.",
    ],
}
