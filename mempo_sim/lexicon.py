"""The words the synthetic world (mempo_sim/world.py) is written with.

Every entity is one word of ``NAMES``: a fixed pool of invented two-syllable names,
shared by every world (each world draws its entities from it without replacement). The
tiny model's tokenizer (mempo_sim/tiny.py) makes each pool name one token, so a name token
is trained in many worlds with different facts, a held-out entity is written with
trained tokens, and reading an answer out of a search result is copying one token. The
rest is the vocabulary of professions, organisations and background sentences.
"""

from __future__ import annotations

import random

SYLLABLES = [
    "ka", "ri", "zor", "van", "mel", "dro", "thi", "sel", "ul", "bar", "nek", "osk", "fen", "qua", "lor", "mi", "tas", "ven", "gra", "hol", "pir", "ed", "yun", "cal", "dex", "ro", "sa", "tum", "lek", "viv", "aur", "bo", "nim", "har", "sut", "kel", "ost", "wen", "ja", "fir",
]  # fmt: skip


NAME_POOL_SIZE = 300


def _name_pool(size: int = NAME_POOL_SIZE) -> tuple[str, ...]:
    """``size`` capitalised two-syllable words ("Zorvan"), drawn once with a fixed seed:
    the same pool on every machine and in every world."""
    words = sorted({(a + b).capitalize() for a in SYLLABLES for b in SYLLABLES if a != b})
    words = [w for w in words if w.lower() not in COMMON_WORDS]
    return tuple(random.Random("mempo-name-pool").sample(words, size))


# Never a name: words the world's sentences and questions are written with.
COMMON_WORDS = {"a", "an", "the", "is", "in", "it", "of", "by", "and", "for", "was", "born", "city"}
NAMES = _name_pool()

PROFESSIONS = ["painter", "engineer", "botanist", "sailor", "weaver", "chemist", "poet", "mason", "judge", "baker"]
ORG_KINDS = ["guild", "institute", "company", "society", "academy", "foundry", "bank", "observatory"]

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
        "In spare hours, {name} collects {thing} and plays the {instrument}.",
        "Friends describe {name} as {trait} and {trait2}.",
        "{name} spent several years studying {topic}.",
        "{name} once wrote a long essay about {topic2}.",
        "As a child, {name} lived near a workshop that made {thing2}.",
        "In the evenings {name} teaches a small class on {topic} to neighbours.",
        "Colleagues remember {name} for a {trait} manner and a fondness for {thing}.",
        "Each {season}, {name} travels to see the {feature} of distant towns.",
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
