"""Batches prepared ahead of the trainer: a bounded queue filled by one background thread.

Offline the thread reads shards; online through vLLM it runs the target's prefill (the engine works in its
own processes, so the capture of the next batches overlaps the training step). The queue holds at most
`depth` batches, in plan order, so the data is the same with or without it.

Two wait figures come out of it (`take_times`): how long the trainer waited for a batch (its data share),
and how long the loader thread was busy; the rest of the wall time the loader (the target) waited on the
trainer because the queue was full.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class Ahead(Generic[T]):
    """`load(item)` for each item of `items`, in order, up to `depth` ahead in a thread (`depth` 0: inline).

    `take()` returns the next result; `close()` cancels what was not started and waits for the running load.
    """

    def __init__(self, load: Callable[[list[int]], T], items: Iterator[list[int]], depth: int):
        self._load, self._items, self.depth = load, items, depth
        self._queue: deque[Future] = deque()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="specdraft-ahead") if depth > 0 else None
        self._lock = threading.Lock()
        self._busy = 0.0  # seconds the loader spent loading, since the last `busy_seconds()`
        self.busy_total = 0.0
        self.wait_total = 0.0  # seconds `take` blocked
        self.t_start = time.time()
        self._fill()

    def _timed(self, item: list[int]) -> T:
        t0 = time.time()
        try:
            return self._load(item)
        finally:
            dt = time.time() - t0
            with self._lock:
                self._busy += dt
                self.busy_total += dt

    def _fill(self) -> None:
        while self._pool and len(self._queue) < self.depth:
            item = next(self._items, None)
            if item is None:
                return
            self._queue.append(self._pool.submit(self._timed, item))

    def take(self) -> T:
        """The next batch (waiting for it when the loader is behind)."""
        t0 = time.time()
        if self._pool is None:
            item = next(self._items, None)
            assert item is not None, "take() past the last batch"
            out = self._timed(item)
        else:
            assert self._queue, "take() past the last batch"
            out = self._queue.popleft().result()
            self._fill()
        self.wait_total += time.time() - t0
        return out

    def busy_seconds(self) -> float:
        """Seconds the loader spent loading since the last call (loads finished by now)."""
        with self._lock:
            busy, self._busy = self._busy, 0.0
        return busy

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown(wait=True, cancel_futures=True)
