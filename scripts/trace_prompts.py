"""Deterministic prompt builders for the attention traces.

Three kinds of prompt, each sized to a target number of tokens:

* needle:     RULER-style needle in a haystack (niah_single with a noise
              haystack): repeated filler sentences with one key-value needle
              ("One of the special magic numbers for <key> is: <7 digits>.")
              inserted at a chosen depth, then the question.
* document:   a long synthetic but natural-looking document (a chronicle of
              fictional towns, generated from templates with a seeded RNG),
              then a question about one fact placed at a chosen depth.
* generation: a (shorter) synthetic document followed by a request for a long
              essay, to record >= 256 decode steps (attention drift).

Everything is generated here from fixed seeds; nothing is downloaded.
Prompts go through the model's chat template (system + user turn + assistant
generation prompt). Following RULER, the needle prompt also starts the
assistant's answer with an answer prefix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# --------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------


@dataclass
class Prompt:
    """A rendered prompt and where its planted fact lies."""

    kind: str                      # "needle" | "document" | "generation"
    text: str                      # full chat-templated text (fed to the model)
    token_ids: list[int]
    fact_char_span: tuple[int, int] | None  # char span of needle/fact in `text`
    info: dict = field(default_factory=dict)  # kind-specific metadata

    def fact_token_span(self, tokenizer) -> tuple[int, int] | None:
        """Half-open token range [start, end) covering the planted fact."""
        if self.fact_char_span is None:
            return None
        enc = tokenizer(self.text, add_special_tokens=False, return_offsets_mapping=True)
        c0, c1 = self.fact_char_span
        hits = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < c1 and e > c0]
        return hits[0], hits[-1] + 1


def render(tokenizer, user: str, assistant_prefix: str = "") -> tuple[str, list[int]]:
    """Apply the chat template and tokenize exactly what the model will see."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    text += assistant_prefix
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text, list(ids)


def fit_to_length(build, n_units_guess: int, target_tokens: int):
    """Find the largest n such that build(n) has <= target_tokens tokens.

    `build(n)` returns (Prompt); token counts grow monotonically with n.
    A secant-style search, then a final linear walk to the exact boundary.
    """
    lo_n, hi_n = 0, None
    n = max(1, n_units_guess)
    cache: dict[int, Prompt] = {}

    def length(k: int) -> int:
        if k not in cache:
            cache[k] = build(k)
        return len(cache[k].token_ids)

    for _ in range(12):
        ln = length(n)
        if ln <= target_tokens:
            lo_n = n
        else:
            hi_n = n
        per_unit = max(1e-3, ln / max(n, 1))
        nxt = int(n + (target_tokens - ln) / per_unit)
        if hi_n is not None:
            nxt = min(nxt, hi_n - 1)
        nxt = max(nxt, lo_n)
        if nxt == n:
            break
        n = nxt
    n = lo_n
    while length(n + 1) <= target_tokens:
        n += 1
    while n > 0 and length(n) > target_tokens:
        n -= 1
    return cache[n] if n in cache else build(n)


# --------------------------------------------------------------------------
# (a) needle in a haystack
# --------------------------------------------------------------------------

HAYSTACK_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

_ADJECTIVES = (
    "amber", "brisk", "calm", "dusty", "eager", "fuzzy", "gentle", "hollow", "icy",
    "jolly", "keen", "lucky", "mellow", "nimble", "quiet", "rusty", "silent", "tidy",
)
_NOUNS = (
    "anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor",
    "island", "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pebble",
)

NEEDLE_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the numbers afterwards.\n"
)


def needle_prompt(tokenizer, target_tokens: int, depth: float, seed: int) -> Prompt:
    """RULER niah_single-style prompt with `target_tokens` tokens at most.

    `depth` in [0, 1] is the fraction of haystack sentences before the needle.
    """
    rng = random.Random(seed)
    key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
    value = str(rng.randint(1_000_000, 9_999_999))
    needle = f"One of the special magic numbers for {key} is: {value}."
    question = f"\nWhat is the special magic number for {key} mentioned in the provided text?"
    answer_prefix = f"The special magic number for {key} mentioned in the provided text is"

    def build(n: int) -> Prompt:
        filler = [HAYSTACK_SENTENCES[i % len(HAYSTACK_SENTENCES)] for i in range(n)]
        at = round(depth * n)
        before = " ".join(filler[:at])
        after = " ".join(filler[at:])
        haystack = " ".join(p for p in (before, needle, after) if p)
        user = NEEDLE_INSTRUCTION + haystack + question
        text, ids = render(tokenizer, user, answer_prefix)
        start = text.index(needle)
        return Prompt("needle", text, ids, (start, start + len(needle)),
                      {"key": key, "value": value, "depth": depth, "needle": needle,
                       "question": question.strip(), "answer_prefix": answer_prefix})

    return fit_to_length(build, target_tokens // 5, target_tokens)


# --------------------------------------------------------------------------
# (b) long document + question
# --------------------------------------------------------------------------

_TOWN_PARTS_A = ("Ash", "Bright", "Cold", "Deep", "East", "Fair", "Glen", "High", "Iron",
                 "Kings", "Long", "Mill", "North", "Oak", "Red", "Salt", "Stone", "West")
_TOWN_PARTS_B = ("brook", "field", "ford", "haven", "hill", "marsh", "mouth", "port",
                 "stead", "vale", "water", "wick", "wood", "bridge", "cliff", "moor")
_FIRST = ("Ada", "Bernard", "Clara", "Duncan", "Edith", "Felix", "Greta", "Harold", "Ida",
          "Jonas", "Katrin", "Lionel", "Martha", "Nils", "Olive", "Peter", "Rosa", "Silas",
          "Thea", "Victor", "Wilma", "Yusuf")
_LAST = ("Abbott", "Barlow", "Carver", "Dalton", "Ellery", "Fenwick", "Garner", "Hale",
         "Ingram", "Jessop", "Kendall", "Lowther", "Marsh", "Norcott", "Osgood", "Pryor",
         "Quill", "Radley", "Sutton", "Thorne", "Varley", "Whitlock")
_TRADES = ("wool", "timber", "salt", "copper", "barley", "cider", "pottery", "glass",
           "rope", "paper", "leather", "herring")
_BUILDINGS = ("library", "grain exchange", "clock tower", "music hall", "infirmary",
              "lighthouse", "observatory", "covered market", "stone bridge", "school of navigation")
_RIVERS = ("Alder", "Brent", "Colne", "Dove", "Esk", "Frome", "Lune", "Ouse", "Tamar", "Wey")
_SEASONS = ("spring", "summer", "autumn", "winter")
_EVENTS = ("a great flood", "a long drought", "a fire in the old quarter", "a harsh winter",
           "an outbreak of fever", "the collapse of the wool price", "a royal visit",
           "the arrival of the railway")

_TEMPLATES = (
    "{town} lies on the {side} bank of the River {river}, where the valley widens into "
    "low pasture and the road from {other} crosses the water.",
    "The first written record of {town} dates from {year}, when a charter granted its "
    "people the right to hold a weekly market.",
    "For most of its history the town lived from {trade}, and by {year2} more than "
    "{count} families worked in that trade.",
    "The {family} family, who came from {other}, built the first {building} in {year3}; "
    "it still stands near the market square.",
    "In {year4} the town suffered {event}, and the council recorded that {count2} houses "
    "had to be rebuilt before the following {season}.",
    "{person}, a {role} born in {town}, is remembered for {deed}.",
    "Every {season} the people of {town} hold a fair at which {trade2} and {trade} are "
    "sold, and musicians come from as far as {other}.",
    "The population grew slowly, from about {pop1} in {year} to nearly {pop2} by {year5}.",
    "Travellers often remarked on the {adj} streets and on the smell of {trade} that hung "
    "over the lower town.",
    "A small museum next to the {building} keeps maps, account books and letters from the "
    "merchants of {town}.",
)
_ROLES = ("schoolteacher", "ship's carpenter", "surveyor", "physician", "printer",
          "clockmaker", "botanist", "mayor", "engineer", "painter")
_DEEDS = ("mapping the marshes south of the river", "founding a free school for the children "
          "of dock workers", "designing the town's first water pipes", "a book of local songs",
          "keeping a weather diary for forty years", "rebuilding the harbor wall",
          "a collection of pressed flowers from the valley")
_ADJ = ("narrow", "steep", "cobbled", "quiet", "crowded", "winding", "broad", "muddy")


def _town_name(rng: random.Random, used: set[str]) -> str:
    while True:
        name = rng.choice(_TOWN_PARTS_A) + rng.choice(_TOWN_PARTS_B)
        if name not in used:
            used.add(name)
            return name


def _town_section(rng: random.Random, town: str, other: str) -> str:
    year = rng.randint(1120, 1500)
    values = dict(
        town=town, other=other, river=rng.choice(_RIVERS),
        side=rng.choice(("northern", "southern", "eastern", "western")),
        year=year, year2=year + rng.randint(100, 250), year3=year + rng.randint(50, 300),
        year4=year + rng.randint(150, 400), year5=year + rng.randint(350, 450),
        trade=rng.choice(_TRADES), trade2=rng.choice(_TRADES),
        count=rng.randint(40, 400), count2=rng.randint(12, 300),
        family=rng.choice(_LAST), building=rng.choice(_BUILDINGS), event=rng.choice(_EVENTS),
        season=rng.choice(_SEASONS),
        person=f"{rng.choice(_FIRST)} {rng.choice(_LAST)}", role=rng.choice(_ROLES),
        deed=rng.choice(_DEEDS), pop1=rng.randint(3, 20) * 100, pop2=rng.randint(25, 90) * 100,
        adj=rng.choice(_ADJ),
    )
    order = list(range(len(_TEMPLATES)))
    rng.shuffle(order)
    sentences = [_TEMPLATES[i].format(**values) for i in order[: rng.randint(6, 9)]]
    # Two short paragraphs per town.
    cut = len(sentences) // 2
    return (f"{town}\n\n" + " ".join(sentences[:cut]) + "\n\n" + " ".join(sentences[cut:]))


def synthetic_document(n_sections: int, seed: int) -> tuple[list[str], list[str]]:
    """Sections (one per fictional town) and the town names, deterministic."""
    rng = random.Random(seed)
    used: set[str] = set()
    towns = [_town_name(rng, used) for _ in range(n_sections + 1)]
    sections = [_town_section(rng, towns[i], towns[i + 1]) for i in range(n_sections)]
    return sections, towns[:n_sections]


DOC_TITLE = "A Chronicle of the River Towns\n\n"


def document_prompt(tokenizer, target_tokens: int, depth: float, seed: int) -> Prompt:
    """A long chronicle with one planted fact at `depth`, then a question on it."""
    rng = random.Random(seed + 7919)
    lighthouse_keeper = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    lamp_year = str(rng.randint(1700, 1899))

    def build(n: int) -> Prompt:
        sections, towns = synthetic_document(max(n, 1), seed)
        at = min(len(sections) - 1, round(depth * (len(sections) - 1)))
        town = towns[at]
        fact = (f"The lighthouse of {town} was first lit in {lamp_year}, and its first keeper "
                f"was {lighthouse_keeper}.")
        head, _, tail = sections[at].partition("\n\n")
        sections = list(sections)
        sections[at] = head + "\n\n" + fact + " " + tail
        doc = DOC_TITLE + "\n\n".join(sections)
        question = (f"\n\nAnswer the question using the chronicle above. In which year was "
                    f"the lighthouse of {town} first lit, and who was its first keeper?")
        text, ids = render(tokenizer, doc + question)
        start = text.index(fact)
        return Prompt("document", text, ids, (start, start + len(fact)),
                      {"town": town, "year": lamp_year, "keeper": lighthouse_keeper,
                       "depth": depth, "fact": fact, "question": question.strip()})

    return fit_to_length(build, target_tokens // 200, target_tokens)


# --------------------------------------------------------------------------
# (c) long generation
# --------------------------------------------------------------------------


def generation_prompt(tokenizer, target_tokens: int, seed: int) -> Prompt:
    """A chronicle followed by a request for a long essay (many decode steps)."""

    def build(n: int) -> Prompt:
        sections, towns = synthetic_document(max(n, 1), seed)
        doc = DOC_TITLE + "\n\n".join(sections)
        request = ("\n\nUsing the chronicle above, write a long and detailed essay about the "
                   "history of these towns: their trades, their buildings, the disasters "
                   "they survived and the people who shaped them. Discuss each town in turn.")
        text, ids = render(tokenizer, doc + request)
        return Prompt("generation", text, ids, None, {"towns": towns})

    return fit_to_length(build, target_tokens // 200, target_tokens)
