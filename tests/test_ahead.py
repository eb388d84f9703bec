"""train/ahead.py: batches prepared ahead in one thread, in order, never more than `depth` ahead."""

from __future__ import annotations

import threading
import time

import pytest

from specdraft.train.ahead import Ahead


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_order_is_the_plans_and_the_queue_is_bounded(depth):
    started, taken = [], []
    lock = threading.Lock()

    def load(item):
        with lock:
            started.append(item[0])
            # never more than `depth` loads started beyond what was taken (+ the one being taken)
            assert len(started) - len(taken) <= max(depth, 1)
        return item[0] * 10

    ahead = Ahead(load, iter([[i] for i in range(8)]), depth)
    out = []
    for _ in range(8):
        time.sleep(0.002)
        out.append(ahead.take())
        taken.append(out[-1])
    ahead.close()
    assert out == [i * 10 for i in range(8)] and started == list(range(8))
    with pytest.raises(AssertionError, match="past the last batch"):
        ahead.take()


def test_wait_and_busy_times_say_who_waited_on_whom():
    """A slow loader: the trainer waits (wait_total ~ the loads); busy_seconds is the loading time."""
    ahead = Ahead(lambda item: time.sleep(0.05) or item, iter([[1], [2], [3]]), 1)
    for _ in range(3):
        ahead.take()
    busy = ahead.busy_seconds()
    ahead.close()
    assert 0.14 <= busy < 0.5 and ahead.wait_total >= 0.1
    assert ahead.busy_seconds() == 0.0  # reset by the call
