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
