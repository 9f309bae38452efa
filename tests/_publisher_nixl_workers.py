"""The child of test_publisher_nixl.py's Ctrl-C case: a NIXL publisher and its subscriber in one
process (two endpoints reach each other as across hosts), so a crash is the child's exit code."""
import signal
import time

import torch
from _support import TIMEOUT, after_large_posts, keyboard_interrupts

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
    conn.send({"pull": pull, "latency": latency, "refused": refused, "generation": generation,
               "whole": whole})
