"""The pair classifier's rule-made training pairs (cache/pair_augment.py): pure logic, no model."""

import random

import pytest

from cache.pair_augment import ANTONYMS, SYNONYMS, LabeledPair, augmented, light_edit, negate, swap_word


def test_a_light_edit_keeps_the_question():
    assert light_edit("How do I tune a guitar?") == "How can I tune a guitar?"
    assert light_edit("So what is a capo?") == "So what's a capo?"
    assert light_edit("Did Freud influence Jung?") == "did freud influence jung"


@pytest.mark.parametrize(
    "text, negated",
    [
        ("Why does my code compile?", "Why doesn't my code compile?"),
        ("So why can I log in from my phone?", "So why can't I log in from my phone?"),
        ("What happens if I miss the deadline?", "What happens if I don't miss the deadline?"),
        ("Is it rude when you leave early?", "Is it rude when you don't leave early?"),
    ],
)
def test_negate_puts_a_negation_where_it_changes_the_question(text, negated):
    assert negate(text) == negated


@pytest.mark.parametrize(
    "text",
    [
        "Is it safe to swim after eating?",  # "Isn't it safe ...?" asks the same
        "What happens if I missed the deadline?",  # a past tense: "don't missed" is no English
        "What if I don't pay?",  # negated already
        "What if I can pay later?",
        "How do I boil an egg?",
    ],
)
def test_negate_leaves_alone_what_it_cannot_surely_negate(text):
    assert negate(text) is None


def test_swap_word_keeps_the_capital_and_touches_one_whole_word():
    rng = random.Random(0)
    assert swap_word("Latest news?", SYNONYMS, rng) in {"Most recent news?", "Newest news?"}
    assert swap_word("Should I upload before noon?", ANTONYMS, random.Random(1)) in {
        "Should I download before noon?",
        "Should I upload after noon?",
    }
    assert swap_word("Is a buyer allowed?", {"buy": ("sell",)}, rng) is None  # "buyer" is not "buy"


def test_no_word_is_its_own_synonym_or_opposite():
    for table in (SYNONYMS, ANTONYMS):
        for word, others in table.items():
            assert word == word.lower() and others and word not in others
    shared = {(w, o) for w, os in SYNONYMS.items() for o in os} & {
        (w, o) for w, os in ANTONYMS.items() for o in os
    }
    assert not shared


def test_augmented_labels_each_rule_and_keeps_the_pairs_first():
    pairs = [
        LabeledPair("Why does the fastest train stop here?", "Why do express trains stop here?", True),
        LabeledPair("Is it X0?", "Is it Y0?", False),
    ]
    assert augmented(pairs, seed=3) == pairs + [LabeledPair("Is it X0?", "Would it be X0?", True)]
    out = augmented(pairs, seed=3, word_rules=True)
    assert out[:2] == pairs
    extra = out[2:]
    assert LabeledPair("Is it X0?", "Would it be X0?", True) in extra
    assert (
        LabeledPair(
            "Why does the fastest train stop here?", "Why doesn't the fastest train stop here?", False
        )
        in extra
    )
    first = [p for p in extra if p.a == pairs[0].a and p.b not in {pairs[0].b}]
    swaps = {p.b: p.same for p in first if "doesn't" not in p.b}
    # one synonym swap (true) and one opposite swap (false) of the first question
    assert sorted(swaps.values()) == [False, True]
    assert augmented(pairs, seed=3, word_rules=True) == out  # the seed fixes the choices


# Found in review: a why-question negated already got a second negation, labeled another question.
@pytest.mark.parametrize(
    "text",
    [
        "Why is my laptop touchpad not working?",
        "Why is my Quest 2 not charging?",
        "Why does a spinning top not fall over?",
    ],
)
def test_negate_does_not_double_a_negation_in_a_why_question(text):
    out = negate(text)
    assert out is None or " not " not in out, out


# Found in review: irregular pasts, adverbs and auxiliaries got a "don't" put in front of them.
@pytest.mark.parametrize(
    "text",
    [
        "How is a stock sale taxed if I held it for more than a year?",
        "How do I know if I tore my rotator cuff?",
        "Best way to pack a television if I threw away its box?",
        "What should I do if I overpaid a vendor's invoice?",
        "Is it against the law for a client to use my freelance work if they never paid me?",
        "What happens if you are late for your flight?",
        "What if I could pay later?",
    ],
)
def test_negate_leaves_alone_what_it_cannot_turn_into_english(text):
    assert negate(text) is None, negate(text)


# Found in review: opposite swaps in yes/no questions ("safe" / "dangerous") contradicted the
# hand-written labels, which call those the same question.
def test_opposite_swap_in_a_yes_no_question_does_not_contradict_the_hand_labels():
    hand = LabeledPair(
        "Is it safe to drink coffee while pregnant?",
        "Is it unsafe to have coffee when you're expecting?",
        True,
    )
    out = augmented([hand], seed=0, word_rules=True)
    contradicting = [
        p
        for p in out
        if not p.same
        and p.a == hand.a
        and p.b
        in {"Is it unsafe to drink coffee while pregnant?", "Is it dangerous to drink coffee while pregnant?"}
    ]
    assert not contradicting, contradicting


# Found in review: names and keywords ("Best Picture", "Big Five", SQL's SELECT) were swapped as words.
@pytest.mark.parametrize(
    "text, bad",
    [
        ("Which film won Best Picture at the 2020 Oscars?", "Which film won Best Photo at the 2020 Oscars?"),
        (
            "What does the Big Five trait openness measure?",
            "What does the Large Five trait openness measure?",
        ),
        (
            "Why is my MySQL SELECT query with LIKE '%term%' so slow?",
            "Why is my MySQL Choose query with LIKE '%term%' so slow?",
        ),
    ],
)
def test_synonym_swap_leaves_proper_nouns_and_keywords_alone(text, bad):
    out = augmented([LabeledPair(text, "unrelated question?", False)], seed=0, word_rules=True)
    assert LabeledPair(text, bad, True) not in out


# Found in review: a word inside an identifier ("use_cache") was swapped.
def test_swap_word_does_not_swap_inside_an_identifier():
    out = swap_word("How do I set use_cache to False?", SYNONYMS, random.Random(0))
    assert out is None or "use_cache" in out, out
