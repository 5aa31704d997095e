# Copyright (c) 2026, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""The training loop's background work (``-last`` copies' links, #38): done in order, off the handing thread, within
the polling interval; drained in the caller's thread; a failure is logged, never raised."""

import logging
import threading
import time

from nemo_patch.training.background import PollingWorker


def test_work_is_done_in_order_off_the_handing_thread_within_the_interval():
    worker = PollingWorker("test-worker", interval=0.01)
    done, threads = [], []

    def item(i):
        def work():
            threads.append(threading.current_thread())
            done.append(i)

        return work

    start = time.monotonic()
    for i in range(5):
        worker.hand(item(i))
    while len(done) < 5 and time.monotonic() - start < 5:
        time.sleep(0.005)
    assert done == list(range(5))
    assert threading.current_thread() not in threads and len(set(threads)) == 1


def test_drain_does_what_is_left_in_the_calling_thread_after_the_work_in_progress():
    worker = PollingWorker("test-worker", interval=0.01)
    started, release, done = threading.Event(), threading.Event(), []

    def slow():
        started.set()
        release.wait(5)
        done.append("slow")

    worker.hand(slow)
    assert started.wait(5)
    worker.hand(lambda: done.append(threading.current_thread().name))
    threading.Timer(0.1, release.set).start()
    assert worker.drain(timeout=5)
    assert done[0] == "slow" and len(done) == 2


def test_a_failure_is_logged_and_the_next_work_still_done(caplog):
    worker = PollingWorker("test-worker", interval=0.01)
    done = []
    worker.hand(lambda: 1 / 0)
    worker.hand(lambda: done.append(1))
    with caplog.at_level(logging.ERROR):
        assert worker.drain(timeout=5)
    assert done == [1] and "background work failed" in caplog.text


def test_an_idle_thread_ends_and_the_next_handoff_starts_another():
    worker = PollingWorker("test-worker", interval=0.01, idle_seconds=0.05)
    done = []
    worker.hand(lambda: done.append(1))
    deadline = time.monotonic() + 5
    while worker._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker._thread is None and done == [1]
    worker.hand(lambda: done.append(2))
    assert worker.drain(timeout=5) and done == [1, 2]


def test_a_drain_from_inside_handed_work_returns_at_once_and_keeps_the_order():
    """Work that reaches a drain (an observer of the coordinator's pass calling an entry point that syncs) neither
    deadlocks on the worker's own lock nor runs the work handed after it out of order."""
    worker = PollingWorker("test-worker", interval=0.01)
    done = []

    def outer():
        done.append(("outer drain", worker.drain(timeout=1)))

    worker.hand(outer)
    worker.hand(lambda: done.append(("after", None)))
    assert worker.drain(timeout=5)
    assert done == [("outer drain", True), ("after", None)]


def test_start_starts_the_thread_before_any_work():
    worker = PollingWorker("test-worker", interval=0.01)
    worker.start()
    assert worker._thread is not None and worker._thread.is_alive()
    thread = worker._thread
    worker.start()  # idempotent
    assert worker._thread is thread
