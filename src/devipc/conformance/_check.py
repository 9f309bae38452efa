"""What a check is: a name, one line on what it proves, and a function that passes (returning a
detail), fails (raising) or skips (raising `Skip` with the reason)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._verdicts import CheckFailed, Skip, expect

if TYPE_CHECKING:
    from ._kit import Kit

__all__ = ["CHECKS", "Check", "CheckFailed", "Skip", "check", "expect"]


@dataclass(frozen=True)
class Check:
    name: str
    proves: str
    run: Callable[[Kit], str | None]  # returns a detail for the table
    fresh_peers: int = 0  # peer processes it uses up (kills or lets exit): started ahead


CHECKS: list[Check] = []


def check(
    name: str,
    proves: str,
    fresh_peers: int = 0,
) -> Callable[[Callable[[Kit], str | None]], Callable[[Kit], str | None]]:
    """Adds the decorated function to CHECKS, in definition order."""

    def add(run: Callable[[Kit], str | None]) -> Callable[[Kit], str | None]:
        CHECKS.append(Check(name, proves, run, fresh_peers))
        return run

    return add
