"""What the benchmarks share: progress on stderr, Markdown tables, the PNG, the doc's sections,
and processes driven through pipes."""

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from .._common import optional

__all__ = [
    "Panel",
    "Piped",
    "Progress",
    "human",
    "markdown",
    "plot",
    "replace_section",
    "require_plotting",
]


class Progress:
    """A tqdm bar on stderr when tqdm is installed (and `lines` is False), else one line per
    step: long runs show where they are."""

    def __init__(self, what: str, lines: bool = False) -> None:
        self.what, self.done, self.total = what, 0, 0
        self._bar: Any = None
        if not lines:
            try:
                self._tqdm = optional("tqdm", "bench")
            except ImportError:
                lines = True
        self.lines = lines

    def start(self, total: int) -> None:
        self.total, self.done = total, 0
        if not self.lines:
            self._bar = self._tqdm.tqdm(
                total=total, desc=self.what, file=sys.stderr, dynamic_ncols=True, leave=True
            )

    def step(self, text: str) -> None:
        """One step done; `text` says what it measured."""
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {self.what}: {text}", file=sys.stderr, flush=True)

    def note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def memcpy_seconds(nbytes: int, rounds: int = 7) -> float:
    """A host copy of `nbytes` by one thread, pages touched beforehand (median of `rounds`):
    the floor under a benchmark's weight transfer of the same bytes."""
    import statistics
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source = torch.ones(nbytes, dtype=torch.uint8)
        target = torch.zeros(nbytes, dtype=torch.uint8)
        times = []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            target.copy_(source)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
    finally:
        torch.set_num_threads(threads)


def median_seconds(call: Any, rounds: int) -> float:
    """The median time of `rounds` calls, after one that pays for connections, mappings and
    first allocations."""
    import statistics
    import time

    call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def human(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def markdown(headers: list[str], rows: list[list], right: int = 1) -> str:
    """A Markdown table; the columns from `right` on are right-aligned (numbers)."""
    align = ["---" if i < right else "---:" for i in range(len(headers))]
    lines = [headers, align, *([str(cell) for cell in row] for row in rows)]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


@dataclass
class Panel:
    """One plot: `series` {name: values along `x`}; bars when `x` are labels, not sizes."""

    title: str
    ylabel: str
    x: list
    series: dict = field(default_factory=dict)
    bars: bool = False
    logy: bool = True


def require_plotting() -> None:
    """Fail before a long run, not after it, when matplotlib is missing."""
    optional("matplotlib", "plot")


def plot(panels: list[Panel], path: str) -> None:
    """The panels side by side in one PNG at `path`."""
    matplotlib = optional("matplotlib", "plot")
    matplotlib.use("Agg")  # files only, no display
    pyplot = optional("matplotlib.pyplot", "plot")
    ticker = optional("matplotlib.ticker", "plot")
    columns = min(2, len(panels))
    rows = -(-len(panels) // columns)
    figure, axes = pyplot.subplots(rows, columns, figsize=(7 * columns, 4.8 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        if panel.bars:
            width = 0.8 / max(1, len(panel.series))
            for i, (name, values) in enumerate(panel.series.items()):
                ax.bar([j + i * width for j in range(len(panel.x))], values, width, label=name)
            ax.set_xticks(
                [j + 0.4 - width / 2 for j in range(len(panel.x))], panel.x, rotation=30, ha="right"
            )
        else:
            for name, values in panel.series.items():
                ax.plot(panel.x, values, marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xticks(panel.x, [human(x) for x in panel.x], rotation=30, ha="right")
            ax.set_xlabel("size")
        if panel.logy:
            ax.set_yscale("log")
            plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
            low, high = ax.get_ylim()
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain if high < 30 * low else ticker.NullFormatter())
        ax.set_title(panel.title)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def replace_section(path: str, section: str, body: str, notes: str | None = None) -> None:
    """Replace the markdown section headed `section` in the file at `path` with that heading
    and `body` (or append them), keeping the old section's lines from `notes` on (hand-written
    method notes)."""
    text = f"{section}\n\n{body}"
    with open(path) as doc:
        content = doc.read()
    at = content.find(section)
    if at >= 0:
        following = re.search(r"^## ", content[at + len(section) :], re.M)
        end = len(content) if following is None else at + len(section) + following.start()
        kept = -1 if notes is None else content.find(notes, at, end)
        if kept >= 0:
            text = text.rstrip("\n") + "\n\n" + content[kept:end].rstrip("\n") + "\n\n"
        content = content[:at] + text.rstrip("\n") + "\n\n" + content[end:]
    else:
        content = content.rstrip("\n") + "\n\n" + text
    with open(path, "w") as doc:
        doc.write(content.rstrip("\n") + "\n")


class Piped:
    """A process running `argv` followed by the numbers of two pipe fds (its commands in, its
    replies out), driven by tuples: `send`, `reply` (an exception it replies is raised here),
    `ask`, and `stop` ("exit", then a kill after 10 s)."""

    def __init__(
        self, argv: Sequence[str], name: str, timeout: float, env: dict[str, str] | None = None
    ):
        ours_in, theirs_out = os.pipe()
        theirs_in, ours_out = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [*argv, str(theirs_in), str(theirs_out)], pass_fds=(theirs_in, theirs_out), env=env
            )
        finally:
            os.close(theirs_in)
            os.close(theirs_out)
        self.commands, self.replies = Connection(ours_out), Connection(ours_in)
        self.name, self.timeout = name, timeout

    def send(self, *command: Any) -> None:
        self.commands.send(command)

    def reply(self, timeout: float | None = None) -> Any:
        timeout = self.timeout if timeout is None else timeout
        if not self.replies.poll(timeout):
            raise TimeoutError(f"no reply from the {self.name} process within {timeout} s")
        answer = self.replies.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def ask(self, *command: Any) -> Any:
        self.send(*command)
        return self.reply()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.send("exit")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(self.timeout)
        self.commands.close()
        self.replies.close()
