"""Shared by every test folder: pytest-jupyter's real server fixtures."""

pytest_plugins = ["pytest_jupyter.jupyter_server"]
