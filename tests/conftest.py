"""Shared by every test folder: pytest-jupyter's real server fixtures. The slowest tests (whole servers
or CLI runs started per test) carry @pytest.mark.slow in their files: `-m "not slow and not gpu"` is
the quick round; `./run test` and CI run everything."""

pytest_plugins = ["pytest_jupyter.jupyter_server"]
