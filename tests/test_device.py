"""The device thread: jobs run one at a time, in order, on one thread; nested jobs run in place."""

from __future__ import annotations

import threading
import time

import pytest

from shadow.server.device import DeviceThread


@pytest.fixture
def device():
    d = DeviceThread()
    yield d
    d.close()


def test_jobs_run_in_order_on_one_thread_and_never_overlap(device):
    seen, threads, running = [], set(), []

    def job(i):
        def run():
            running.append(i)
            assert len(running) == 1  # nothing else runs meanwhile
            threads.add(threading.current_thread().name)
            time.sleep(0.002)
            seen.append(i)
            running.remove(i)
            return i * i
        return run

    futures = [device.submit(job(i)) for i in range(20)]
    assert [f.result() for f in futures] == [i * i for i in range(20)]
    assert seen == list(range(20)) and threads == {"shadow-device"}


def test_a_job_that_hands_in_a_job_runs_it_in_place(device):
    assert device.run(lambda: device.run(lambda: 41) + 1) == 42
    assert device.run(lambda: device.run_if_idle(lambda: 7)) == (True, 7)


def test_an_exception_reaches_the_caller_and_the_thread_goes_on(device):
    with pytest.raises(ZeroDivisionError):
        device.run(lambda: 1 / 0)
    assert device.run(lambda: "alive") == "alive" and device.idle()


def test_run_if_idle_does_not_wait_while_the_device_is_held(device):
    with device.hold():
        assert not device.idle()
        answers = []  # asked from another thread: had it waited, it would wait for the hold forever
        asker = threading.Thread(target=lambda: answers.append(device.run_if_idle(lambda: 1)))
        asker.start()
        asker.join(30)
        assert answers == [(False, None)]
        late = device.submit(lambda: "after")
        time.sleep(0.05)
        assert not late.done()  # held: no job runs
    assert late.result(timeout=5) == "after"
    assert device.run_if_idle(lambda: 2) == (True, 2)


def test_jobs_after_close_are_refused_not_left_waiting():
    device = DeviceThread()
    assert device.run(lambda: 1) == 1
    device.close()
    device.close()  # twice is fine
    with pytest.raises(RuntimeError, match="stopped"):
        device.run(lambda: 2)


def test_each_kind_of_job_is_timed_and_a_job_run_in_place_counts_in_its_callers(device):
    device.run(lambda: time.sleep(0.03), "ask")
    for _ in range(3):
        device.run(lambda: time.sleep(0.001), "reader")
    device.run(lambda: device.run(lambda: time.sleep(0.02), "settle"), "turn")  # in place: the turn's time
    with pytest.raises(ZeroDivisionError):
        device.run(lambda: 1 / 0, "predict")  # a job that failed is timed too
    times = device.times.status()
    assert set(times) == {"ask", "reader", "turn", "predict"}
    assert times["reader"]["count"] == 3 and times["ask"]["count"] == times["turn"]["count"] == 1
    assert 30 <= times["ask"]["max_ms"] == times["ask"]["p50_ms"] == times["ask"]["p99_ms"] == times["ask"]["mean_ms"]
    assert times["turn"]["max_ms"] >= 20
    r = times["reader"]
    assert 1 <= r["p50_ms"] <= r["p99_ms"] == r["max_ms"] and r["seconds"] == pytest.approx(3 * r["mean_ms"] / 1000, abs=1e-5)


def test_the_quantiles_are_of_the_last_jobs_kept_and_the_counts_of_all():
    from shadow.server.device import JobTimes

    t = JobTimes(keep=4)
    for ms in (100, 1, 2, 3, 4):
        t.add("reader", ms / 1000)
    s = t.status()["reader"]
    assert s["count"] == 5 and s["max_ms"] == 100 and s["mean_ms"] == 22  # all five
    assert s["p50_ms"] == 2 and s["p99_ms"] == 4  # the last four: 1, 2, 3, 4 (nearest rank)
    assert JobTimes().status() == {}
