"""The kernel's start (run once, from startup.py): caps torch lazily (torch_cap.py), registers the `%gpucap`
stand-in (stub.py), chains the user's own PYTHONSTARTUP. Nothing here may break the kernel, and nothing is
printed: the kernel's stderr is the server's terminal, where a line would have neither the server's format nor
a reader. Every problem is recorded in the kernel's state, said once after the first cell (state.tell_once)
and by `%gpucap`.
"""

from __future__ import annotations

import os

from . import state as state_module
from .torch_cap import cap_torch


def run(user_namespace: dict) -> None:
    state = state_module.from_environment()
    state_module.STATE = state
    # The secret stays in this process only: subprocesses, `!env` and printed environments never see it.
    from ..shared.env_vars import TOKEN

    os.environ.pop(TOKEN, None)
    try:
        if state.devices:
            cap_torch(state)
    except Exception as error:  # broad: torch's own code may raise anything; uncapped, and said after the first cell
        state.problems.append(f"torch cap not applied: {error!r}")
    load_magic(state)
    watch_parking(state)
    chain_user_startup(user_namespace, state)


def load_magic(state: state_module.KernelCapState) -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    try:
        # A stand-in that loads the full magic at its first use: kernel start stays cheap.
        from .stub import register

        register(shell)
    except Exception as error:
        state.problems.append(f"%gpucap not loaded: {error!r}")
        try:  # still say so after the first cell
            shell.events.register("post_run_cell", lambda result=None: state_module.tell_once(state))
        except Exception:  # broad: a shell of another kind; the problem is still in %gpucap
            pass


def watch_parking(state: state_module.KernelCapState) -> None:
    """A kernel with a GPU that can reach its server: the server's request before a park is answered, and a
    cell after a park waits for the resume where it can say why (park_wait.py)."""
    if not state.devices:
        return
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None:
            return
        from .park_wait import ParkWatch, install

        install(shell, ParkWatch(park_state_of_this_kernel))
    except Exception as error:  # broad: a shell of another kind must not stop the kernel's start; said after a cell
        state.problems.append(f"parking's cell wait not installed: {error!r}")


def park_state_of_this_kernel():
    """This kernel's park state from its server; the REST client is loaded at the first question (only after a
    park: kernel start stays cheap). None when the kernel cannot reach its server."""
    from .client import QuotaClient

    client = QuotaClient.from_environment()
    return client.park_state() if client is not None else None


def chain_user_startup(user_namespace: dict, state: state_module.KernelCapState) -> None:
    from ..shared.env_vars import USER_STARTUP

    user_startup = os.environ.pop(USER_STARTUP, None)
    if user_startup:
        # Child Pythons see the user's own startup file again, not ours.
        os.environ["PYTHONSTARTUP"] = user_startup
        try:
            with open(user_startup, encoding="utf-8") as source:
                code = compile(source.read(), user_startup, "exec")
            exec(code, user_namespace)
        except Exception as error:  # broad: the user's own startup code may raise anything; said after a cell
            state.problems.append(f"your PYTHONSTARTUP {user_startup} failed: {error!r}")
    else:
        os.environ.pop("PYTHONSTARTUP", None)
