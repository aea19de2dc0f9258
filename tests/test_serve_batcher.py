"""Dynamic batching: batches form up to max-batch, the queue delay is honoured, batching can be
turned off, a full queue refuses at once, and a failing batch fails only its own requests."""

from __future__ import annotations

import threading
import time

import pytest

from gpulens.serve.batcher import Batcher, Pending, QueueFull, ShuttingDown


class Recorder:
    """An execute() that records its batches (optionally slow, or failing), and a done()."""

    def __init__(self, delay_s: float = 0.0, fail_on: int | None = None):
        self.batches: list[list[int]] = []
        self.done: list[Pending] = []
        self.delay_s, self.fail_on = delay_s, fail_on
        self.release = threading.Event()
        self.release.set()
        self.finished = threading.Condition()

    def execute(self, payloads, instance):
        self.release.wait(5)
        self.batches.append(list(payloads))
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail_on in payloads:
            raise RuntimeError("boom")
        return [p * 10 for p in payloads], (1000, 2000, 3000)

    def on_done(self, batch):
        with self.finished:
            self.done.extend(batch)
            self.finished.notify_all()

    def wait_for(self, n: int, timeout_s: float = 5.0) -> None:
        with self.finished:
            assert self.finished.wait_for(lambda: len(self.done) >= n, timeout_s), self.done


def make(rec: Recorder, **kw) -> Batcher:
    kw = {"max_batch": 4, "max_delay_s": 0.0, "max_queue": 100, **kw}
    return Batcher("m", rec.execute, rec.on_done, **kw).start()


def test_queued_requests_form_batches_of_at_most_max_batch():
    rec = Recorder()
    rec.release.clear()  # hold the worker so that requests queue up
    b = make(rec, max_batch=4)
    items = [Pending(i, 1) for i in range(10)]
    for it in items:
        b.submit(it)
    time.sleep(0.05)
    rec.release.set()
    rec.wait_for(10)
    b.stop()
    sizes = [len(x) for x in rec.batches]
    assert max(sizes) == 4 and sum(sizes) == 10
    assert sorted(p for batch in rec.batches for p in batch) == list(range(10))
    assert [it.result for it in items] == [i * 10 for i in range(10)]  # each gets its share
    assert all(it.batch_size == len(next(x for x in rec.batches if it.payload in x))
               for it in items)  # fmt: skip
    assert all(it.compute_ns == (1000, 2000, 3000) and it.queue_ns > 0 for it in items)


def test_samples_not_requests_count_toward_max_batch():
    rec = Recorder()
    rec.release.clear()
    b = make(rec, max_batch=8)
    for n in (5, 2, 3, 1):
        b.submit(Pending(n, n))
    time.sleep(0.05)
    rec.release.set()
    rec.wait_for(4)
    b.stop()
    # 5 + 2 = 7 fits; 3 would make 10 > 8: FIFO, the next batch is 3 + 1
    assert rec.batches == [[5], [2, 3, 1]] or rec.batches == [[5, 2], [3, 1]]
    assert all(sum(x) <= 8 for x in rec.batches)


def test_the_oldest_request_waits_at_most_the_queue_delay():
    rec = Recorder()
    b = make(rec, max_batch=64, max_delay_s=0.15)
    first = Pending(1, 1)
    t0 = time.perf_counter()
    b.submit(first)
    time.sleep(0.05)
    b.submit(Pending(2, 1))  # joins the batch: the delay has not passed
    rec.wait_for(2)
    waited = time.perf_counter() - t0
    b.stop()
    assert rec.batches == [[1, 2]]
    assert 0.14 <= first.queue_ns / 1e9 < 0.3 and waited < 0.4


def test_a_full_batch_does_not_wait_for_the_delay():
    rec = Recorder()
    b = make(rec, max_batch=2, max_delay_s=5.0)
    t0 = time.perf_counter()
    b.submit(Pending(1, 1))
    b.submit(Pending(2, 1))
    rec.wait_for(2)
    b.stop()
    assert rec.batches == [[1, 2]] and time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("max_batch", [0, 1])
def test_batching_off_runs_each_request_alone(max_batch):
    rec = Recorder()
    rec.release.clear()
    b = make(rec, max_batch=max_batch, max_delay_s=0.5)
    for i in range(5):
        b.submit(Pending(i, 3))  # several samples in one request still run together
    rec.release.set()
    rec.wait_for(5)
    b.stop()
    assert rec.batches == [[0], [1], [2], [3], [4]]
    assert b.max_delay_s == 0.0


def test_a_full_queue_refuses_at_once_and_a_stopped_one_too():
    rec = Recorder()
    rec.release.clear()
    b = make(rec, max_batch=1, max_queue=2)
    b.submit(Pending(0, 1))
    time.sleep(0.05)  # the worker holds item 0; the queue is empty again
    b.submit(Pending(1, 1))
    b.submit(Pending(2, 1))
    assert b.depth() == 2
    with pytest.raises(QueueFull):
        b.submit(Pending(3, 1))
    rec.release.set()
    rec.wait_for(3)
    b.stop()
    with pytest.raises(ShuttingDown):
        b.submit(Pending(4, 1))


def test_stop_fails_what_still_waits_and_a_bad_batch_fails_only_itself():
    rec = Recorder(fail_on=1)
    b = make(rec, max_batch=1)
    items = [Pending(i, 1) for i in range(3)]
    for it in items:
        b.submit(it)
    rec.wait_for(3)
    assert isinstance(items[1].error, RuntimeError) and items[1].result is None
    assert items[0].result == 0 and items[2].result == 20  # the worker lives on
    rec.release.clear()
    b.submit(Pending(9, 1))  # taken by the worker, held
    time.sleep(0.05)
    waiting = Pending(10, 1)
    b.submit(waiting)
    threading.Timer(0.1, rec.release.set).start()
    b.stop()
    assert isinstance(waiting.error, ShuttingDown)


def test_several_instances_run_batches_at_the_same_time():
    rec = Recorder(delay_s=0.2)
    b = make(rec, max_batch=1, instances=3)
    t0 = time.perf_counter()
    for i in range(3):
        b.submit(Pending(i, 1))
    rec.wait_for(3)
    b.stop()
    assert time.perf_counter() - t0 < 0.45  # three 0.2 s batches side by side, not 0.6 s
