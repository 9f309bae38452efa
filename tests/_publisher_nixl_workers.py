"""The child of test_publisher_nixl.py's Ctrl-C case: a NIXL publisher and its subscriber in one
process (two endpoints reach each other as across hosts), so a crash is the child's exit code."""

import functools
import os
import signal
import threading
import time

import torch
from _support import TIMEOUT, after_large_posts, keyboard_interrupts, wait_until

import devipc


def publisher_on_the_last_device(conn, relay: bool) -> None:
    """A trainer on the last openreg device of its host (the test sets OPENREG_DEVICE_COUNT),
    with or without `relay`: sends its token, then publishes each time it is asked, until told
    to stop."""
    import devipc_openreg  # noqa: F401 - the device, also where autoload is off

    last = torch.openreg.device_count() - 1  # type: ignore[attr-defined]
    weights = {"w": torch.arange(1024, dtype=torch.float32, device=f"openreg:{last}")}
    with devipc.WeightPublisher(weights, copy=True, transport="nixl", relay=relay) as publisher:
        conn.send(publisher.token())
        while conn.recv() == "publish":
            conn.send(publisher.publish(wait=False))


def interrupted_pull(conn, nbytes: int) -> None:
    """Ctrl-C lands while wait() pulls a generation of `nbytes` (raised by the pull's own post,
    so it is in flight); then tensors() refuses the memory the cut pull may still write, and the
    next wait() pulls the generation whole."""
    import devipc_openreg  # noqa: F401 - the device, also where autoload is off

    keyboard_interrupts()
    weights = {"w": torch.full((nbytes // 4,), 3.0, device="openreg")}
    publisher = devipc.WeightPublisher(weights, copy=True, transport="nixl")
    subscriber = devipc.WeightSubscriber(publisher.token())
    publisher.publish(wait=False)
    started = time.monotonic()
    subscriber.wait(timeout=TIMEOUT)
    pull = time.monotonic() - started  # the whole pull, its start-up included
    subscriber.ack()
    weights["w"].fill_(5.0)
    sent: list[float] = []

    def interrupt(state):
        if not sent:
            sent.append(time.monotonic())
            signal.raise_signal(signal.SIGINT)

    with after_large_posts(nbytes, interrupt):
        publisher.publish(wait=False)
        try:
            subscriber.wait(timeout=TIMEOUT)
            latency = None
        except KeyboardInterrupt:
            latency = time.monotonic() - sent[0]
    try:
        subscriber.tensors()
        refused = False
    except ValueError:
        refused = True
    generation = subscriber.wait(timeout=TIMEOUT)
    whole = bool((subscriber.tensors()["w"] == 5.0).all())
    subscriber.ack()
    subscriber.close()
    publisher.close()
    conn.send(
        {
            "pull": pull,
            "latency": latency,
            "refused": refused,
            "generation": generation,
            "whole": whole,
        }
    )


def _sigint_later(after: float, sent: list, timers: list, state) -> None:
    """At the first large post: a process-directed SIGINT (as a terminal's Ctrl-C) `after`
    seconds later, its time put into `sent`."""

    def sigint():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    if not timers:
        timers.append(threading.Timer(after, sigint))
        timers[0].start()


def interrupted_pulls(conn, nbytes: int, runs: int, after: float) -> None:
    """Issue 53, item 1: generations of `nbytes` (CPU), each pull interrupted `after` seconds
    into its transfer until `runs` were (a timer starved past the pull's end on a busy machine
    is not a run: the generation went through, and another is published, 5 times at most);
    after each, the same subscriber's next wait() takes that generation, checked against its
    checksum. One set-up for all runs; the latencies, the runs the pull ended first, and how
    many more NIXL registrations the subscriber's endpoint holds afterwards are sent back."""
    keyboard_interrupts()
    weights = {"w": torch.zeros(nbytes // 4)}
    publisher = devipc.WeightPublisher(weights, copy=True, transport="nixl")
    subscriber = devipc.WeightSubscriber(publisher.token())
    publisher.publish(wait=False, checksum=True)
    started = time.monotonic()
    subscriber.wait(timeout=TIMEOUT)  # the first pull (fresh pages): not interrupted
    pull = time.monotonic() - started
    subscriber.ack()
    transport = subscriber._backend._endpoints[0]._transport
    ranges = len(transport._ranges)
    results, ended_first = [], 0
    while len(results) < runs and ended_first < 5:
        weights["w"].fill_(float(len(results) + ended_first + 1))
        generation = publisher.publish(wait=False, checksum=True)
        sent: list[float] = []
        timers: list[threading.Timer] = []
        latency = None
        with after_large_posts(nbytes, functools.partial(_sigint_later, after, sent, timers)):
            try:
                subscriber.wait(timeout=TIMEOUT)
                timers[0].join()  # the pull ended first: the signal lands here, not in wait()
            except KeyboardInterrupt:
                latency = time.monotonic() - sent[0]
        timers[0].join()
        if subscriber.generation == generation:  # taken before the signal came
            ended_first += 1
        else:
            got = subscriber.wait(timeout=TIMEOUT)
            subscriber.verify()  # ChecksumError unless the bytes are those published
            results.append({"latency": latency, "generation": got, "expected": generation})
        subscriber.ack()
    wait_until(
        lambda: not transport.in_flight,  # the heartbeat's write may be under way
        lambda: f"{len(transport.in_flight)} NIXL requests still held",
    )
    grown = len(transport._ranges) - ranges
    subscriber.close()
    publisher.close()
    conn.send({"pull": pull, "runs": results, "ended_first": ended_first, "grown": grown})
