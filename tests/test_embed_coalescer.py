"""Group-commit embedding (cache/embed_coalescer.py): concurrent calls share a pass and each gets its own
rows; a lone caller runs at once; a failed pass raises in each of its callers and the next one works;
a pass takes at most max_texts. The logic runs over a fake embedder whose passes the test holds open
with an Event; the last test checks on the real MiniLM that a text's vector does not change with the
batch it is padded into."""

from __future__ import annotations

import gc
import inspect
import sys
import threading
import traceback
import weakref

import numpy as np
import pytest

from cache.embed_coalescer import CoalescerConfig, CoalescingEmbedder, EmbeddingFailed
from tests.conftest import wait_for

DIM = 4


def vector(text: str) -> np.ndarray:
    """A row that names its text: [number, len, 1, 0] for "t<number>"."""
    return np.array([float(text[1:]), len(text), 1.0, 0.0], dtype=np.float32)


class FakeEmbedder:
    """Records every pass (its texts and thread); `hold` keeps the passes numbered in it open until
    `release` is set; `fail` makes the passes numbered in it raise."""

    dim = DIM

    def __init__(self, hold: set[int] = frozenset(), fail: set[int] = frozenset()):
        self.passes: list[list[str]] = []
        self.threads: list[str] = []
        self.hold, self.fail = set(hold), set(fail)
        self.entered = threading.Event()
        self.release = threading.Event()

    def embed(self, texts: list[str]) -> np.ndarray:
        number = len(self.passes)
        self.passes.append(list(texts))
        self.threads.append(threading.current_thread().name)
        if number in self.hold:
            self.entered.set()
            assert self.release.wait(20), "the test never released the pass"
        if number in self.fail:
            raise RuntimeError(f"pass {number} failed")
        return np.stack([vector(t) for t in texts])

    def fits(self, texts: list[str]) -> list[bool]:
        return [len(t) < 10 for t in texts]


class Caller(threading.Thread):
    def __init__(self, coalescer: CoalescingEmbedder, texts: list[str]):
        super().__init__(name=f"caller-{texts[0]}", daemon=True)
        self.coalescer, self.texts = coalescer, texts
        self.rows: np.ndarray | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.rows = self.coalescer.embed(self.texts)
        except BaseException as exc:
            self.error = exc


def hold_first_pass(coalescer: CoalescingEmbedder, fake: FakeEmbedder) -> Caller:
    """A caller whose pass (the first) is under way and held open."""
    first = Caller(coalescer, ["t0"])
    first.start()
    assert fake.entered.wait(10)
    return first


def queue(coalescer: CoalescingEmbedder, batches: list[list[str]]) -> list[Caller]:
    """Callers started one after another, each queued behind the held pass before the next starts, so
    that the queue's order is known."""
    callers = []
    for texts in batches:
        caller = Caller(coalescer, texts)
        caller.start()
        callers.append(caller)
        assert wait_for(lambda n=len(callers): coalescer.waiting == n, 10, 0.001)
    return callers


def join(callers: list[Caller]) -> None:
    for caller in callers:
        caller.join(20)
        assert not caller.is_alive(), f"{caller.name} is still waiting"


def test_a_lone_caller_runs_its_own_pass_at_once_on_its_own_thread():
    fake = FakeEmbedder()
    coalescer = CoalescingEmbedder(fake)
    rows = coalescer.embed(["t1", "t22"])
    assert np.array_equal(rows, np.stack([vector("t1"), vector("t22")]))
    assert fake.threads == [threading.current_thread().name]
    assert coalescer.embed(["t3"])[0][0] == 3  # one after another: a pass each, none waited
    assert coalescer.snapshot() == {"calls": 2, "queued": 0, "passes": 2, "texts": 3, "errors": 0}
    assert coalescer.embed([]).shape == (0, DIM) and len(fake.passes) == 2
    assert coalescer.fits(["t1", "t1234567890"]) == [True, False] and coalescer.dim == DIM


def test_callers_that_arrive_during_a_pass_share_the_next_and_each_gets_its_own_rows():
    fake = FakeEmbedder(hold={0})
    coalescer = CoalescingEmbedder(fake)
    first = hold_first_pass(coalescer, fake)
    batches = [[f"t{10 * i + j}" for j in range(1 + i % 3)] for i in range(1, 13)]  # 1 to 3 texts each
    callers = queue(coalescer, batches)
    fake.release.set()
    join([first, *callers])
    assert first.error is None and first.rows[0][0] == 0
    for caller in callers:
        assert caller.error is None
        assert np.array_equal(caller.rows, np.stack([vector(t) for t in caller.texts])), caller.name
    assert fake.passes == [["t0"], [t for texts in batches for t in texts]]  # all twelve in one, in order
    # the second pass ran on one of the queued callers' threads, not on the first caller's
    assert fake.threads[1] in {c.name for c in callers}
    stats = coalescer.snapshot()
    assert stats == {"calls": 13, "queued": 12, "passes": 2, "texts": 1 + sum(map(len, batches)), "errors": 0}


def test_many_threads_at_once_each_get_their_own_rows():
    fake = FakeEmbedder()
    coalescer = CoalescingEmbedder(fake, CoalescerConfig(max_texts=8))
    start = threading.Barrier(16)

    class Racer(Caller):
        def run(self) -> None:
            start.wait(10)
            for round_no in range(50):
                texts = [f"t{1000 * round_no + 10 * int(self.texts[0][1:]) + j}" for j in range(3)]
                rows = self.coalescer.embed(texts)
                if not np.array_equal(rows, np.stack([vector(t) for t in texts])):
                    self.error = AssertionError(f"{self.name} got rows of {rows[:, 0]} for {texts}")
                    return

    racers = [Racer(coalescer, [f"t{i}"]) for i in range(16)]
    for racer in racers:
        racer.start()
    join(racers)
    assert [r.error for r in racers] == [None] * 16
    assert all(len(p) <= 8 for p in fake.passes)
    stats = coalescer.snapshot()
    assert stats["calls"] == 16 * 50 and stats["texts"] == 16 * 50 * 3 and stats["passes"] == len(fake.passes)


def test_a_failed_pass_raises_in_each_of_its_callers_and_the_next_pass_works():
    fake = FakeEmbedder(hold={0}, fail={1})
    coalescer = CoalescingEmbedder(fake)
    first = hold_first_pass(coalescer, fake)
    failing = queue(coalescer, [["t1"], ["t2", "t3"], ["t4"]])
    fake.release.set()
    join([first, *failing])
    assert first.error is None and first.rows[0][0] == 0  # its pass was not the failed one
    assert fake.passes[1] == ["t1", "t2", "t3", "t4"]
    for caller in failing:
        assert isinstance(caller.error, EmbeddingFailed) and str(caller.error.__cause__) == "pass 1 failed"
    assert coalescer.embed(["t5"])[0][0] == 5  # not wedged: a lone caller runs at once again
    assert coalescer.snapshot()["errors"] == 1 and coalescer.snapshot()["passes"] == 3


def test_a_first_pass_that_fails_raises_in_its_caller_only():
    fake = FakeEmbedder(hold={0}, fail={0})
    coalescer = CoalescingEmbedder(fake)
    first = hold_first_pass(coalescer, fake)
    behind = queue(coalescer, [["t1"], ["t2"]])
    fake.release.set()
    join([first, *behind])
    assert isinstance(first.error, RuntimeError)
    assert [c.error for c in behind] == [None, None] and [c.rows[0][0] for c in behind] == [1, 2]


def test_an_inner_embedder_that_returns_the_wrong_shape_raises_instead_of_handing_out_wrong_rows():
    class Short(FakeEmbedder):
        def embed(self, texts):
            return super().embed(texts)[:-1]

    coalescer = CoalescingEmbedder(Short())
    with pytest.raises(EmbeddingFailed, match="for 2 texts") as raised:
        coalescer.embed(["t1", "t2"])
    assert isinstance(raised.value.__cause__, ValueError)
    assert coalescer.snapshot()["errors"] == 1


def test_a_pass_takes_at_most_max_texts_first_come_first_and_a_larger_call_runs_whole():
    fake = FakeEmbedder(hold={0})
    coalescer = CoalescingEmbedder(fake, CoalescerConfig(max_texts=4))
    first = hold_first_pass(coalescer, fake)
    batches = [["t1", "t2"], ["t3"], ["t4", "t5"], ["t6"], ["t7", "t8", "t9", "t10", "t11"], ["t12"]]
    callers = queue(coalescer, batches)
    fake.release.set()
    join([first, *callers])
    for caller in callers:
        assert caller.error is None
        assert np.array_equal(caller.rows, np.stack([vector(t) for t in caller.texts])), caller.name
    # [t1 t2 t3] then t4 t5 would make 5: the next pass; a call of 5 texts runs alone, whole
    assert fake.passes == [
        ["t0"], ["t1", "t2", "t3"], ["t4", "t5", "t6"], ["t7", "t8", "t9", "t10", "t11"], ["t12"]
    ]  # fmt: skip


def test_max_texts_must_be_positive():
    with pytest.raises(ValueError):
        CoalescingEmbedder(FakeEmbedder(), CoalescerConfig(max_texts=0))


# ---------------------------------------------------------------------------------------------------
# The real MiniLM: padding into a batch does not move a text's vector
# ---------------------------------------------------------------------------------------------------

TEXTS = [
    "how do i reset my router password",
    "boiling point of water on everest",
    "which chess opening is best for a beginner playing with the white pieces when the opponent "
    "answers every move quickly and aggressively",
    "hi",
    "why does my car battery drain overnight when the engine is off and the lights are all switched off",
    "how long should bread dough rise",
]


@pytest.fixture(scope="module")
def minilm():
    from cache.embedder import MiniLMEmbedder

    return MiniLMEmbedder()


def test_coalesced_minilm_vectors_equal_single_ones(minilm):
    singles = np.stack([minilm.embed([t])[0] for t in TEXTS])

    class Held:
        """The real embedder, its first pass held open so that the others queue behind it."""

        dim = minilm.dim

        def __init__(self):
            self.sizes: list[int] = []
            self.entered, self.release = threading.Event(), threading.Event()

        def embed(self, texts):
            self.sizes.append(len(texts))
            if len(self.sizes) == 1:
                self.entered.set()
                assert self.release.wait(20)
            return minilm.embed(texts)

        def fits(self, texts):
            return minilm.fits(texts)

    held = Held()
    coalescer = CoalescingEmbedder(held)
    first = Caller(coalescer, [TEXTS[0]])
    first.start()
    assert held.entered.wait(10)
    callers = queue(coalescer, [[t] for t in TEXTS[1:]])
    held.release.set()
    join([first, *callers])
    assert held.sizes == [1, len(TEXTS) - 1]  # the other five padded to the longest in one pass
    coalesced = np.stack([c.rows[0] for c in [first, *callers]])
    cosines = np.sum(coalesced * singles, axis=1)
    assert np.all(np.abs(1.0 - cosines) < 1e-5), cosines
    assert np.allclose(coalesced, singles, atol=1e-5)
    # and the texts do differ in length: the short ones were padded
    assert max(map(len, TEXTS[1:])) > 3 * min(map(len, TEXTS[1:]))


def test_minilm_fits_does_not_wait_for_a_forward_pass(minilm):
    """A lookup checks `fits` before it embeds: behind a pass it would come out alone and run its own
    pass instead of queueing for the next one with the others."""
    answered = threading.Event()
    with minilm._model_lock:  # a forward pass under way
        checker = threading.Thread(target=lambda: answered.set() if minilm.fits(["hi"]) == [True] else None)
        checker.start()
        assert answered.wait(10), "fits waited for the forward pass"
    checker.join(10)


class Interrupting(FakeEmbedder):
    """Its pass number 1 raises KeyboardInterrupt in the thread that runs it (what SIGINT's handler
    raises in the main thread, the execute thread, when it embeds inline)."""

    def embed(self, texts: list[str]) -> np.ndarray:
        if len(self.passes) == 1:
            self.passes.append(list(texts))
            self.threads.append(threading.current_thread().name)
            raise KeyboardInterrupt
        return super().embed(texts)


def test_an_interrupt_stays_in_the_thread_that_ran_the_pass_and_its_other_callers_get_an_error():
    fake = Interrupting(hold={0})
    coalescer = CoalescingEmbedder(fake)
    first = hold_first_pass(coalescer, fake)
    behind = queue(coalescer, [["t1"], ["t2"]])
    fake.release.set()
    join([first, *behind])
    led = next(c for c in behind if c.name == fake.threads[1])
    other = next(c for c in behind if c is not led)
    assert isinstance(led.error, KeyboardInterrupt), "raised where it happened, not swallowed"
    assert isinstance(other.error, EmbeddingFailed), "not an interrupt in a thread that never got one"
    assert coalescer.embed(["t5"])[0][0] == 5 and coalescer.snapshot()["errors"] == 1


def test_each_caller_gets_its_own_error_whose_traceback_holds_only_its_frames():
    fake = FakeEmbedder(hold={0}, fail={1})
    coalescer = CoalescingEmbedder(fake)
    first = hold_first_pass(coalescer, fake)
    failing = queue(coalescer, [["t1"], ["t2"], ["t3"]])
    fake.release.set()
    join([first, *failing])
    errors = [c.error for c in failing]
    assert len({id(e) for e in errors}) == 3 and len({id(e.__cause__) for e in errors}) == 1
    for caller in failing:  # one object raised in three threads gathered all their frames
        frames = [frame for frame, _ in traceback.walk_tb(caller.error.__traceback__)]
        assert {f.f_locals.get("self") for f in frames} <= {caller, coalescer}


def test_a_failed_pass_is_freed_with_its_callers_error_without_waiting_for_the_cyclic_gc():
    class Marker:
        pass

    class Holding(FakeEmbedder):
        def embed(self, texts):
            self.marker = weakref.ref(activations := Marker())  # what a forward pass's frame holds
            raise RuntimeError(f"failed with {activations!r}")

    inner = Holding()
    coalescer = CoalescingEmbedder(inner)
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(EmbeddingFailed):
            coalescer.embed(["t1"])
        assert inner.marker() is None
    finally:
        gc.enable()


def interrupt_at(function, needle: str):
    """A trace function that raises KeyboardInterrupt at the first line of `function` holding `needle`:
    what SIGINT's handler raises in the main thread, at that bytecode."""
    code = function.__code__
    lines = inspect.getsourcelines(function)[0]
    target = code.co_firstlineno + next(i for i, line in enumerate(lines) if needle in line)

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == target:
            raise KeyboardInterrupt
        return local

    return lambda frame, event, arg: local if frame.f_code is code else None


@pytest.mark.parametrize(
    "function, needle",
    [
        (CoalescingEmbedder._lead_once, "self._queue.popleft()"),  # a call listed, still queued
        (CoalescingEmbedder._lead_once, "self._running = True"),  # the lead taken, the pass not begun
        (CoalescingEmbedder._lead_once, "texts = [text"),  # before the pass
        (CoalescingEmbedder._answer, "c.done = True"),  # while the callers are answered
    ],
    ids=["leaving-the-queue", "taking-the-lead", "before-the-pass", "answering"],
)
def test_an_interrupt_anywhere_in_the_leaders_bookkeeping_does_not_wedge_the_next_pass(function, needle):
    coalescer = CoalescingEmbedder(FakeEmbedder())
    sys.settrace(interrupt_at(function, needle))
    try:
        with pytest.raises(KeyboardInterrupt):
            coalescer.embed(["t1"])
    finally:
        sys.settrace(None)
    assert coalescer.embed(["t2"])[0][0] == 2, "the next caller runs its pass"
    assert coalescer.waiting == 0
