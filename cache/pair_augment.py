"""Rule-made training pairs for the pair classifier (cache/pair_training.py).

Hand-written pairs teach by example, and a few thousand examples are memorised rather than generalised:
the first classifier fitted every training pair, scored its own "Which items are movers not allowed to
transport?" trap at 0.0005, and still gave "Why does my code compile?" / "Why doesn't my code compile?"
0.9997, and "Is chocolate toxic to dogs?" / "... poisonous to dogs?" 0.03. Each rule here turns every
training question it applies to into a pair whose label the rule fixes, so one contrast is shown in
hundreds of contexts:

- always: a light rewording of the frame ("How do I" / "How can I"), the same question;
- with ``word_rules`` (``python -m cache.pair_training --word-rules``; not used for the shipped weights):
  one word swapped for a synonym ("latest" / "most recent"), the same question; one word swapped for
  its opposite ("upload" / "download"), another question; a negation put into a "why" question or an
  "if I" clause, another question.

The word lists are generic English, but a few synonym pairs (deadline / due date, latest / most recent,
easiest / simplest, kid / child) were added after reading them among the first fresh set's failures: that
set is a development set; the blind ones were never read.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class LabeledPair:
    a: str
    b: str
    same: bool


# (what to find, lower-cased; what to put instead): rewordings of a question's frame
_LIGHT_EDITS = (
    ("how do i ", "how can I "),
    ("how can i ", "how do I "),
    ("what is ", "what's "),
    ("what's ", "what is "),
    ("what are ", "which are "),
    ("is it ", "would it be "),
    ("can i ", "am I able to "),
    ("should i ", "do I need to "),
    ("why does ", "what makes "),
    ("how much ", "what amount of "),
)

# word -> words that ask the same in any question it appears in (one direction where the reverse is not
# safe: "right" is also a direction, "get" has many meanings)
SYNONYMS: dict[str, tuple[str, ...]] = {
    "buy": ("purchase",),
    "purchase": ("buy",),
    "fix": ("repair",),
    "repair": ("fix",),
    "start": ("begin",),
    "begin": ("start",),
    "help": ("assist",),
    "need": ("require",),
    "require": ("need",),
    "choose": ("pick", "select"),
    "select": ("choose",),
    "locate": ("find",),
    "use": ("utilize",),
    "receive": ("get",),
    "talk": ("speak",),
    "speak": ("talk",),
    "remove": ("get rid of", "take out"),
    "big": ("large",),
    "large": ("big",),
    "small": ("little",),
    "fast": ("quick",),
    "quick": ("fast",),
    "fastest": ("quickest",),
    "quickest": ("fastest",),
    "easiest": ("simplest",),
    "simplest": ("easiest",),
    "easy": ("simple",),
    "latest": ("most recent", "newest"),
    "newest": ("latest",),
    "cheap": ("inexpensive", "low-cost"),
    "cheapest": ("least expensive",),
    "expensive": ("costly", "pricey"),
    "safe": ("okay", "ok"),
    "allowed": ("permitted",),
    "permitted": ("allowed",),
    "difficult": ("hard",),
    "main": ("primary",),
    "typical": ("usual",),
    "usual": ("typical",),
    "enough": ("sufficient",),
    "entire": ("whole",),
    "whole": ("entire",),
    "weird": ("strange",),
    "strange": ("weird",),
    "huge": ("enormous",),
    "kid": ("child",),
    "kids": ("children",),
    "child": ("kid",),
    "children": ("kids",),
    "photo": ("picture",),
    "photos": ("pictures",),
    "picture": ("photo",),
    "movie": ("film",),
    "movies": ("films",),
    "doctor": ("physician",),
    "problem": ("issue",),
    "problems": ("issues",),
    "deadline": ("due date",),
    "trip": ("journey",),
    "couch": ("sofa",),
    "sofa": ("couch",),
    "tv": ("television",),
    "dad": ("father",),
    "mom": ("mother",),
    "beginner": ("novice",),
    "beginners": ("novices",),
    "symptoms": ("signs",),
    "gift": ("present",),
    "usually": ("typically",),
    "typically": ("usually",),
    "often": ("frequently",),
    "frequently": ("often",),
    "roughly": ("approximately",),
    "approximately": ("roughly",),
    "immediately": ("right away",),
    "maybe": ("perhaps",),
    "fee": ("charge",),
    "amount": ("quantity",),
    "method": ("way",),
    "rules": ("regulations",),
    "tips": ("advice",),
    "car": ("automobile",),
    "house": ("home",),
    "mistakes": ("errors",),
}

# word -> its opposites: one swapped in makes another question
ANTONYMS: dict[str, tuple[str, ...]] = {
    "before": ("after",),
    "after": ("before",),
    "buy": ("sell",),
    "sell": ("buy",),
    "increase": ("decrease", "reduce"),
    "reduce": ("increase",),
    "decrease": ("increase",),
    "maximum": ("minimum",),
    "minimum": ("maximum",),
    "max": ("min",),
    "hot": ("cold",),
    "warm": ("cool",),
    "first": ("last",),
    "start": ("stop", "end"),
    "stop": ("start",),
    "open": ("close",),
    "enable": ("disable",),
    "disable": ("enable",),
    "upload": ("download",),
    "download": ("upload",),
    "import": ("export",),
    "export": ("import",),
    "add": ("remove",),
    "remove": ("add",),
    "more": ("less", "fewer"),
    "less": ("more",),
    "fewer": ("more",),
    "higher": ("lower",),
    "lower": ("higher",),
    "high": ("low",),
    "low": ("high",),
    "above": ("below",),
    "below": ("above",),
    "early": ("late",),
    "late": ("early",),
    "earliest": ("latest",),
    "send": ("receive",),
    "receive": ("send",),
    "win": ("lose",),
    "lose": ("gain",),
    "allowed": ("forbidden", "banned"),
    "legal": ("illegal",),
    "illegal": ("legal",),
    "safe": ("dangerous", "unsafe"),
    "best": ("worst",),
    "worst": ("best",),
    "good": ("bad",),
    "bad": ("good",),
    "short": ("long",),
    "heavy": ("light",),
    "dry": ("wet",),
    "wet": ("dry",),
    "full": ("empty",),
    "empty": ("full",),
    "inside": ("outside",),
    "outside": ("inside",),
    "indoor": ("outdoor",),
    "indoors": ("outdoors",),
    "outdoor": ("indoor",),
    "north": ("south",),
    "south": ("north",),
    "east": ("west",),
    "west": ("east",),
    "morning": ("evening",),
    "evening": ("morning",),
    "summer": ("winter",),
    "winter": ("summer",),
    "men": ("women",),
    "women": ("men",),
    "install": ("uninstall",),
    "uninstall": ("install",),
    "lock": ("unlock",),
    "unlock": ("lock",),
    "connect": ("disconnect",),
    "disconnect": ("connect",),
    "subscribe": ("unsubscribe",),
    "encrypt": ("decrypt",),
    "deposit": ("withdraw",),
    "withdraw": ("deposit",),
    "borrow": ("lend",),
    "lend": ("borrow",),
    "arrive": ("leave",),
    "fastest": ("slowest",),
    "cheapest": ("most expensive",),
    "cheap": ("expensive",),
    "expensive": ("cheap",),
    "raise": ("lower",),
    "gain": ("lose",),
    "new": ("old",),
    "younger": ("older",),
    "older": ("younger",),
    "without": ("with",),
    "always": ("never",),
    "never": ("always",),
    "true": ("false",),
    "positive": ("negative",),
    "negative": ("positive",),
    "input": ("output",),
    "output": ("input",),
    "overweight": ("underweight",),
    "underweight": ("overweight",),
    "overcooked": ("undercooked",),
}

_NEGATABLE = {
    "does": "doesn't",
    "do": "don't",
    "did": "didn't",
    "is": "isn't",
    "are": "aren't",
    "was": "wasn't",
    "were": "weren't",
    "can": "can't",
    "should": "shouldn't",
    "will": "won't",
    "would": "wouldn't",
    "could": "couldn't",
    "has": "hasn't",
    "have": "haven't",
}
_WHY_AUX = re.compile(r"\b(why) (" + "|".join(_NEGATABLE) + r")\b", re.IGNORECASE)
# "if I go" -> "if I don't go": the verb must be a plain present, not an auxiliary, an adverb or a past
# ("-ed", or one of the common irregular ones: "if I don't held it" is no English)
_NOT_A_PRESENT = (
    "don't do not can't can cannot am are is was were have had has will would could should may might must "
    "never always already just also still ever really "
    "held tore threw flew overpaid paid got went lost left forgot broke sent spent took made bought brought "
    "came ate drank fell found gave knew ran said saw sold told thought wore won wrote drove hit cut put "
    "set let read hurt quit split shut"
).split()
_IF_I = re.compile(
    r"\b(if|when) (I|you|we|they) (?!(?:" + "|".join(map(re.escape, _NOT_A_PRESENT)) + r")\b)"
    r"([a-z]+(?<!ed))\b",
    re.IGNORECASE,
)
_NEGATED = re.compile(r"\b(not|never|no|nothing|nobody|without)\b|n't\b", re.IGNORECASE)
_YES_NO = re.compile(
    r"^\s*(is|are|am|was|were|can|could|should|would|will|do|does|did|has|have|may|might|must)\b", re.I
)
# a whole word: not part of an identifier ("use_cache"), a number ("i7") or a longer word
_WORD = re.compile(r"(?<![\w'-])[A-Za-z][A-Za-z'-]*(?![\w'-])")


def light_edit(text: str) -> str:
    """``text`` reworded by the first rule of ``_LIGHT_EDITS`` that applies, else lower-cased without its
    final punctuation; the meaning is the same either way."""
    lowered = text.lower()
    for old, new in _LIGHT_EDITS:
        at = lowered.find(old)
        if at >= 0:
            new = new[:1].upper() + new[1:] if at == 0 and text[:1].isupper() else new
            return text[:at] + new + text[at + len(old) :]
    return lowered.rstrip(" ?.!")


def swap_word(text: str, table: dict[str, tuple[str, ...]], rng: random.Random) -> str | None:
    """``text`` with one of its words (chosen by ``rng``) replaced by one of the table's words for it, the
    capital kept; None when no word of it is in the table. Only lower-case words count, or the first one
    capitalised: "Best Picture", "Big Five" and SQL's "SELECT" are names, not words to swap."""
    spots = [
        m
        for m in _WORD.finditer(text)
        if m.group().lower() in table
        and (m.group().islower() or (m.start() == 0 and m.group()[1:].islower()))
    ]
    if not spots:
        return None
    m = rng.choice(spots)
    new = rng.choice(table[m.group().lower()])
    if m.group()[:1].isupper():
        new = new[:1].upper() + new[1:]
    return text[: m.start()] + new + text[m.end() :]


def negate(text: str) -> str | None:
    """``text`` with a negation put in where it surely changes the question: "why does" -> "why doesn't",
    "if I go" -> "if I don't go"; None when neither applies. ("Is it safe ...?" -> "Isn't it safe ...?"
    asks the same, so yes/no questions are left alone, and so is a question negated already: "Why is it
    not working?" -> "Why isn't it not working?" changes nothing.)"""
    if _NEGATED.search(text):
        return None
    m = _WHY_AUX.search(text)
    if m:
        return text[: m.start(2)] + _NEGATABLE[m.group(2).lower()] + text[m.end(2) :]
    m = _IF_I.search(text)
    if m:
        return text[: m.start(3)] + "don't " + text[m.start(3) :]
    return None


def augmented(pairs: list[LabeledPair], seed: int = 0, word_rules: bool = False) -> list[LabeledPair]:
    """``pairs`` plus, for every other question of a false pair, its ``light_edit`` (true): the same
    question, nearly the same words, next to a trap just as close. With ``word_rules``, also for every
    distinct question its synonym swap (true), its opposite swap (false) and its negation (false) where
    the rule applies. The shipped classifier is fitted without them: with them it reads negations (0.0003
    for "Why does my code compile?" / "Why doesn't ...", 0.9997 without) and synonyms, but the setting
    chosen with it served more wrong answers on the held-out half and the blind sets (docs/INTERNALS.md)."""
    rng = random.Random(seed)
    false_questions = list(dict.fromkeys(p.a for p in pairs if not p.same))
    extra = [LabeledPair(q, light_edit(q), True) for q in false_questions[::2] if light_edit(q) != q]
    if not word_rules:
        return pairs + extra
    for q in dict.fromkeys(q for p in pairs for q in (p.a, p.b)):
        # "Is it safe to ...?" / "Is it dangerous to ...?" ask one thing (the hand-written pairs say so)
        tables = ((SYNONYMS, True),) if _YES_NO.match(q) else ((SYNONYMS, True), (ANTONYMS, False))
        for table, same in tables:
            swapped = swap_word(q, table, rng)
            if swapped is not None and swapped != q:
                extra.append(LabeledPair(q, swapped, same))
        negated = negate(q)
        if negated is not None:
            extra.append(LabeledPair(q, negated, False))
    return pairs + extra
