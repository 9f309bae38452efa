"""The kit's command-line options for pytest (pytest parses them before it imports a --pyargs
package, so they come as a plugin):

    pytest -p devipc.conformance.pytest_plugin --pyargs devipc.conformance --device openreg

Without the plugin, DEVIPC_CONFORMANCE_DEVICE (and _INDEX, _HOOKS_MODULES, comma-separated) name
the device. Loaded only by pytest; it imports nothing of pytest's.
"""

from typing import Any


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("devipc conformance")
    group.addoption("--device", dest="devipc_device", help="the device type under test")
    group.addoption(
        "--device-index",
        dest="devipc_index",
        type=int,
        default=None,
        help="the device index (default 0)",
    )
    group.addoption(
        "--hooks-module",
        dest="devipc_modules",
        action="append",
        default=[],
        help="import this module first in every process of the kit; repeatable",
    )
