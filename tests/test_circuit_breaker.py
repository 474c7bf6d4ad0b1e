"""Circuit breaker state machine on a fake clock."""

from __future__ import annotations

import threading

import pytest

from cache.circuit_breaker import BreakerState, CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_opens_after_threshold_consecutive_failures(clock):
    b = CircuitBreaker(failure_threshold=3, reset_timeout_s=5.0, clock=clock)
    for _ in range(2):
        assert b.allow()
        b.record_failure()
    assert b.state is BreakerState.CLOSED
    assert b.allow()
    b.record_failure()
    assert b.state is BreakerState.OPEN and b.opens == 1
    assert not b.allow() and not b.allow()
    assert b.rejections == 2


def test_success_resets_the_consecutive_count(clock):
    b = CircuitBreaker(failure_threshold=3, clock=clock)
    for _ in range(5):
        b.record_failure()
        b.record_failure()
        b.record_success()
    assert b.state is BreakerState.CLOSED and b.opens == 0 and b.consecutive_failures == 0


def test_half_open_lets_one_probe_through_and_success_closes(clock):
    b = CircuitBreaker(failure_threshold=1, reset_timeout_s=5.0, clock=clock)
    b.record_failure()
    clock.now += 4.99
    assert not b.allow()
    clock.now += 0.01
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow()  # the probe
    assert not b.allow()  # only one at a time
    b.record_success()
    assert b.state is BreakerState.CLOSED
    assert all(b.allow() for _ in range(10))
    assert b.rejections == 2


def test_failed_probe_reopens_for_another_period(clock):
    b = CircuitBreaker(failure_threshold=2, reset_timeout_s=5.0, clock=clock)
    b.record_failure()
    b.record_failure()
    clock.now += 5.0
    assert b.allow()
    b.record_failure()  # one failure in half-open is enough
    assert b.state is BreakerState.OPEN and b.opens == 2
    clock.now += 4.0
    assert not b.allow()
    clock.now += 1.0
    assert b.allow()
    b.record_success()
    assert b.state is BreakerState.CLOSED


def test_lost_probe_does_not_wedge_half_open(clock):
    b = CircuitBreaker(failure_threshold=1, reset_timeout_s=2.0, clock=clock)
    b.record_failure()
    clock.now += 2.0
    assert b.allow()  # the probe's caller never reports
    clock.now += 1.0
    assert not b.allow()
    clock.now += 1.0
    assert b.allow()  # a new probe after another reset period


def test_late_results_while_open_are_ignored(clock):
    b = CircuitBreaker(failure_threshold=1, reset_timeout_s=5.0, clock=clock)
    b.record_failure()
    clock.now += 3.0
    b.record_success()  # a call started before the breaker opened
    assert b.state is BreakerState.OPEN
    b.record_failure()
    assert b.opens == 1
    clock.now += 2.0  # the open period was not extended by the late failure
    assert b.state is BreakerState.HALF_OPEN


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(reset_timeout_s=-1)


def test_thread_safe_single_probe(clock):
    """Many threads racing at half-open: exactly one probe gets through."""
    b = CircuitBreaker(failure_threshold=1, reset_timeout_s=1.0, clock=clock)
    b.record_failure()
    clock.now += 1.0
    allowed: list[bool] = []
    lock = threading.Lock()
    start = threading.Barrier(16)

    def worker() -> None:
        start.wait()
        for _ in range(100):
            ok = b.allow()
            with lock:
                allowed.append(ok)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(allowed) == 1
    assert b.rejections == len(allowed) - 1
