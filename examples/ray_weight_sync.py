"""RL-style weight sync between Ray actors: a trainer actor publishes its weights after every
step, engine actors subscribe with the tokens they are handed as actor arguments, and each
checks every generation against the trainer's weights (and the generation's checksum). A
third actor gets the trainer's newest weights as a Ray object through devipc's transport
(`tensor_transport="DEVIPC"`), without a copy, as an evaluator would.

    trainer = Trainer.remote(transport)              # WeightPublisher(model, transport=...)
    engines = [Engine.remote(ray.get(trainer.token.remote())) for _ in range(ENGINES)]
    ray.get([trainer.step.remote(s)] + [e.update.remote() for e in engines])

The same code runs on one node and across nodes: `--transport nixl` names the path between
hosts (each engine pulls a generation with one-sided NIXL reads), the default is the same-host
one (engines map the trainer's memory). Run: `.venv/bin/python examples/ray_weight_sync.py
[--transport nixl]`; it starts a local Ray cluster and stops it.
"""

import argparse
import os

import ray
import torch

import devipc
import devipc.ray
import devipc_openreg  # noqa: F401  (the reference device, in the driver and in every actor)

TIMEOUT = 60  # seconds: every wait and get is bounded (--timeout: a busy machine's)
STEPS = 4
ENGINES = 2

devipc.ray.register_transport()  # before the classes: ray.method checks the name it is given


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(
        "openreg"
    )


def sums(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-tensor sums, for comparing weights across processes as plain numbers."""
    return {name: t.double().sum().item() for name, t in tensors.items()}


@ray.remote
class Trainer:
    def __init__(self, transport: str, timeout: float):
        self.timeout = timeout
        torch.set_num_threads(1)  # several processes on one host: one core each
        self.model = make_model()
        devipc.pack_module(self.model)  # one allocation: generations are sent without a copy
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.publisher = devipc.WeightPublisher(self.model, transport=transport)

    def token(self) -> bytes:
        return self.publisher.token()

    def wait_engines(self, count: int) -> None:
        """Until `count` engines opened their tokens: with copy=False, one that opens after a
        publish starts with the next generation."""
        self.publisher.wait_subscribers(count, timeout=self.timeout)

    def step(self, step: int) -> tuple[int, dict[str, float]]:
        """One optimizer step, then a generation; returns once every engine acknowledged it."""
        inputs = torch.randn(8, 16, device="openreg")
        self.model(inputs).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        generation = self.publisher.publish(timeout=self.timeout, checksum=True)
        return generation, sums(self.model.state_dict())

    @ray.method(tensor_transport="DEVIPC")
    def weights(self) -> list[torch.Tensor]:
        """The newest weights as a Ray object: an actor that reads it maps this memory."""
        return list(self.model.state_dict().values())


@ray.remote
class Engine:
    def __init__(self, token: bytes, timeout: float):
        self.timeout = timeout
        torch.set_num_threads(1)
        self.model = make_model()  # its own weights, overwritten by every generation
        self.subscriber = devipc.WeightSubscriber(token)

    def update(self) -> tuple[int, dict[str, float]]:
        generation = self.subscriber.wait(timeout=self.timeout)
        self.subscriber.verify()  # the bytes held are those published (CRC-32)
        self.subscriber.copy_into(self.model)
        self.subscriber.ack()
        return generation, sums(self.model.state_dict())


@ray.remote(enable_tensor_transport=True)
class Evaluator:
    def evaluate(self, weights: list[torch.Tensor]) -> tuple[list[float], bool]:
        """Sums of the weights it was handed, and whether they are another process's memory."""
        return (
            [t.double().sum().item() for t in weights],
            all(devipc.received_via_ipc(t) for t in weights),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--transport",
        choices=("ipc", "nixl"),
        default="ipc",
        help="the publisher's path: one host (ipc) or across hosts (nixl)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=TIMEOUT,
        help="seconds every wait and get may take (actors start slowly on a busy machine)",
    )
    args = parser.parse_args()
    timeout = args.timeout
    here = os.path.dirname(os.path.abspath(__file__))
    # the actors import this module by name (its classes): Ray's workers find it here
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster of this run alone
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        trainer = Trainer.remote(args.transport, timeout)
        engines = [
            Engine.remote(ray.get(trainer.token.remote(), timeout=timeout), timeout)
            for _ in range(ENGINES)
        ]
        ray.get(trainer.wait_engines.remote(ENGINES), timeout=timeout)
        for step in range(STEPS):
            (generation, expected), *seen = ray.get(
                [trainer.step.remote(step)] + [engine.update.remote() for engine in engines],
                timeout=timeout,
            )
            matched = all(got == (generation, expected) for got in seen)
            print(
                f"step {step}: generation {generation}, {len(seen)} engines "
                f"{'match' if matched else 'DIFFER FROM'} the trainer"
            )
            if not matched:
                raise SystemExit(f"an engine's weights differ at generation {generation}")
        latest, mapped = ray.get(
            Evaluator.remote().evaluate.remote(trainer.weights.remote()), timeout=timeout
        )
        if latest != list(expected.values()) or not mapped:
            raise SystemExit("the evaluator did not get the trainer's newest weights zero-copy")
        print("the evaluator read the trainer's newest weights through DEVIPC, zero-copy")
        print("all engines matched the trainer at every step")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
