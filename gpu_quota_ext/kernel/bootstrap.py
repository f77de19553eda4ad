"""Runs once at kernel start (from startup.py): caps torch lazily, loads `%gpucap`, chains the user's
own PYTHONSTARTUP. Nothing here may break the kernel, and nothing is printed: the kernel's stderr is the
server's terminal, where a line would have neither the server's format nor a reader. Every problem is
recorded in the kernel's state, said once after the first cell (state.tell_once) and by `%gpucap`.
"""

from __future__ import annotations

import os
import sys

from . import state as state_module
from .torch_cap import (
    TorchImportWatcher,
    alloc_conf_variable,
    apply_current_caps,
    installed_torch_version,
    merge_alloc_conf,
    reads_fraction_from_alloc_conf,
)


def run(user_namespace: dict) -> None:
    state = state_module.from_environment()
    state_module.STATE = state
    # The secret stays in this process only: subprocesses, `!env` and printed environments never see it.
    from ..names import TOKEN

    os.environ.pop(TOKEN, None)
    try:
        if state.devices:
            cap_torch(state)
    except Exception as error:
        state.problems.append(f"torch cap not applied: {error!r}")
    load_magic(state)
    chain_user_startup(user_namespace, state)


def cap_torch(state: state_module.KernelCapState, env=os.environ) -> None:
    version = installed_torch_version()
    routes = []
    if reads_fraction_from_alloc_conf(version):
        # One fraction for every device and every child process: the tightest one.
        fraction = min(d.cap / d.total for d in state.devices)
        name = alloc_conf_variable(env)
        env[name] = merge_alloc_conf(env.get(name), fraction)
        routes.append(f"{name} (torch {version}, inherited by child processes)")
    install_lazy_hook(state)
    routes.append("set_per_process_memory_fraction at first CUDA use")
    state.torch_route = " + ".join(routes)


def install_lazy_hook(state: state_module.KernelCapState) -> None:
    """Apply `state`'s caps when the kernel first uses CUDA (at once if it already does).

    The hook reads the caps from `state` when it runs, not when it is installed: a `%gpucap` change made
    before the first CUDA use is the cap applied then. Installed once per kernel.
    """
    if state.hook_installed:
        return
    state.hook_installed = True

    def on_torch_import(torch) -> None:
        def apply() -> None:
            try:
                apply_current_caps(torch, state)
            except Exception as error:
                state.problems.append(f"torch cap not applied at CUDA start: {error!r}")

        if torch.cuda.is_initialized():
            apply()
        else:
            torch.cuda._lazy_call(apply)

    if "torch" in sys.modules:
        on_torch_import(sys.modules["torch"])
    else:
        TorchImportWatcher(on_torch_import).install()


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
        from .lazy import register

        register(shell)
    except Exception as error:
        state.problems.append(f"%gpucap not loaded: {error!r}")
        try:  # still say so after the first cell
            shell.events.register("post_run_cell", lambda result=None: state_module.tell_once(state))
        except Exception:
            pass


def chain_user_startup(user_namespace: dict, state: state_module.KernelCapState) -> None:
    from ..names import USER_STARTUP

    user_startup = os.environ.pop(USER_STARTUP, None)
    if user_startup:
        # Child Pythons see the user's own startup file again, not ours.
        os.environ["PYTHONSTARTUP"] = user_startup
        try:
            with open(user_startup, encoding="utf-8") as source:
                code = compile(source.read(), user_startup, "exec")
            exec(code, user_namespace)
        except Exception as error:
            state.problems.append(f"your PYTHONSTARTUP {user_startup} failed: {error!r}")
    else:
        os.environ.pop("PYTHONSTARTUP", None)
