"""Cancellation polls: at most once per interval per request, never on a request's first ask."""

from __future__ import annotations

from engine.cancel_poll import PollSchedule, ThrottledCancelCheck


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_key_is_due_once_per_interval_and_not_at_first_sight():
    clock = Clock()
    polls = PollSchedule(interval_s=0.05, clock=clock)
    assert not polls.due("a"), "the first sight starts the interval"
    clock.now += 0.049
    assert not polls.due("a")
    clock.now += 0.002
    assert polls.due("a") and not polls.due("a")
    assert not polls.due("b"), "keys are independent"
    polls.forget("a")
    assert not polls.due("a"), "a forgotten key starts over"


def test_the_schedule_is_bounded():
    polls = PollSchedule(limit=3, clock=Clock())
    for key in range(10):
        polls.due(key)
    assert len(polls._next) == 3


def test_a_throttled_check_asks_only_when_due():
    clock, asked = Clock(), []

    def ask() -> bool:
        asked.append(clock.now)
        return True

    check = ThrottledCancelCheck(ask, PollSchedule(interval_s=0.05, clock=clock), key=7)
    results = []
    for _ in range(20):  # 20 engine steps of 10 ms
        results.append(check())
        clock.now += 0.01
    assert len(asked) == 3 and results.count(True) == 3  # at 50, 100 and 150 ms of steps 0-190 ms
    assert results[0] is False, "a request's first step never pays for an ask"
