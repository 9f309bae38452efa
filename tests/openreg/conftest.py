"""Fixtures of the openreg tests."""

import pytest
from _native import Gate


@pytest.fixture
def gate():
    """A Gate that is opened at the end whatever happened, so no stream stays blocked on it."""
    g = Gate()
    yield g
    g.open()
