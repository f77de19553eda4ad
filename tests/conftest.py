"""Shared by every test folder: pytest-jupyter's real server fixtures, and the `slow` marker on tests
in files other helpers are editing this round (the seam: they move these into the files as
@pytest.mark.slow, then the list goes)."""

import pytest

pytest_plugins = ["pytest_jupyter.jupyter_server"]

# The slowest tests (whole servers or CLI runs started per test: 7 to 23 s each on a busy 2-core machine).
SLOW_ELSEWHERE = (
    "tests/integration/test_cli.py::",
    "tests/integration/test_bad_config.py::",
    "tests/integration/test_monitor_stall.py::test_sigterm_during_a_hung_nvml_call_stops_the_server_promptly",
    "tests/integration/test_monitor_stall.py::test_a_hung_nvml_call_makes_the_monitor_stalled_then_ok_again",
    "tests/integration/test_refusals.py::TestRefusalsLeaveNothing::test_hundreds_of_refusals",
    "tests/integration/test_watchdog.py::test_restart_gives_a_fresh_process_and_keeps_the_grant",
)


def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.startswith(SLOW_ELSEWHERE):
            item.add_marker(pytest.mark.slow)
