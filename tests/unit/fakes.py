"""Stand-ins for what the parker and the monitor are given (the server's kernels, the monitor, the ledger), shared by
the unit tests that build a Parker or a Monitor without a server.

Each subclasses the Protocol or class it stands in for, and tests/unit/test_fakes.py checks each against it with
`differences` (every member a Protocol asks for, every overridden method's parameters, sync or async), so a
change of the interface fails there at once instead of leaving a fake that answers to the old one."""

from __future__ import annotations

import asyncio
import datetime
import inspect
import threading
import typing
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from gpu_quota_ext.devices.fake_nvml import FakeNvml
from gpu_quota_ext.kernel.client import QuotaClient
from gpu_quota_ext.ledger.interface import Grant, HeldGrants
from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
from gpu_quota_ext.parking.parker import ParkedKernels, Parker, Sampling
from gpu_quota_ext.usage import Sample
from gpu_quota_ext.usage.kernels import KernelActions, KernelEnds, KernelRoots
from gpu_quota_ext.usage.processes import ProcTable
from gpu_quota_ext.usage.sampling import DeviceReading

KERNEL = "k1"
UUID = "GPU-0"


def utc_ago(seconds: float) -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=seconds)


# --- the server's kernels ---------------------------------------------------------------------------------------


class ParkerKernels(ParkedKernels):
    """The kernels as the parker reads them (usage.KernelManagerView): each one's execution state and last
    activity, which a test changes through `by_id` (or `kernel`, the first); no iopub, no restarter."""

    def __init__(self, states: Optional[Mapping[str, Optional[str]]] = None, idle_for: float = 0.0):
        since = utc_ago(idle_for)
        self.by_id = {
            kernel_id: SimpleNamespace(execution_state=state, last_activity=since)
            for kernel_id, state in (states if states is not None else {KERNEL: "idle"}).items()
        }

    @property
    def kernel(self) -> SimpleNamespace:
        return next(iter(self.by_id.values()))

    def kernel_ids(self) -> List[str]:
        return list(self.by_id)

    def activity(self, kernel_id: str) -> Tuple[Optional[str], Optional[datetime.datetime]]:
        kernel = self.by_id.get(kernel_id)
        return (kernel.execution_state, kernel.last_activity) if kernel is not None else (None, None)

    def watch_status(self, kernel_id: str, on_state: Callable[[str], object]) -> Optional[Callable[[], None]]:
        return None  # no iopub here: the parker falls back to samples and the calls a test makes

    def on_restart(self, kernel_id: str, callback: Callable[[], object]) -> Optional[Callable[[], None]]:
        return None  # no restarter here: nothing finds a held kernel's process dead, nothing to stop

    def exit_code(self, kernel_id: str) -> Optional[int]:
        return None  # no process ended


class UsageKernels(KernelRoots, KernelEnds, KernelActions):
    """The kernels as the monitor, the lifecycle and the watchdog read them: `roots` (pid -> kernel id), idle; what
    the watchdog did lands in `acted`, the lifecycle's callbacks in `dead_callbacks`, `dead` says who died."""

    def __init__(self, roots: Optional[Mapping[int, str]] = None):
        self._roots = dict(roots or {})
        self.acted: List[Tuple[str, str]] = []
        self.dead_callbacks: Dict[str, Callable[[], object]] = {}
        self.dead: set = set()

    def kernel_ids(self) -> List[str]:
        return list(self._roots.values())

    def roots(self) -> Dict[int, str]:
        return dict(self._roots)

    def starting_ids(self) -> Set[str]:
        return set()  # every kernel here has started

    def activity(self, kernel_id: str) -> Tuple[Optional[str], Optional[datetime.datetime]]:
        return "idle", None  # jupyter_server's view (parking reads it)

    def on_dead(self, kernel_id: str, callback: Callable[[], object]) -> None:
        self.dead_callbacks[kernel_id] = callback

    async def dead_ids(self) -> List[str]:
        return sorted(self.dead)

    async def act(self, kernel_id: str, action: str) -> None:
        self.acted.append((kernel_id, action))


class ProcSnapshot(ProcTable):
    """A process table that does not change: each PID's parent, the kernel id its environment names, its uids, and
    NVML's PIDs of another namespace (read on each `namespace_aliases` call, counted in `scans`)."""

    has_proc = True

    def __init__(
        self,
        parents: Optional[Mapping[int, int]] = None,
        named: Optional[Mapping[int, str]] = None,
        uids: Optional[Mapping[int, Tuple[int, ...]]] = None,
        aliases: Optional[Mapping[int, int]] = None,
    ):
        self.parents, self.named = dict(parents or {}), dict(named or {})
        self.uids, self.aliases = dict(uids or {}), dict(aliases or {})
        self.scans = 0

    def parent_of(self, pid: int) -> Optional[int]:
        return self.parents.get(pid)

    def kernel_in_environ(self, pid: int) -> Optional[str]:
        return self.named.get(pid)

    def uids_of(self, pid: int) -> Tuple[int, ...]:
        return self.uids.get(pid, ())

    def exists(self, pid: int) -> bool:
        return pid in self.parents

    def namespace_aliases(self) -> Dict[int, int]:
        self.scans += 1
        return dict(self.aliases)


# --- the monitor ------------------------------------------------------------------------------------------------


class StillMonitor(Sampling):
    """A monitor whose last sample is the one given and stays; NVML cannot be read afresh."""

    def __init__(self, sample: Sample):
        self.latest = sample

    def sample_soon(self) -> None:
        pass

    def device_used_now(self, index: int) -> Optional[int]:
        return None


class NvmlMonitor(Sampling):
    """The monitor's last sample, made from the fake NVML by `take`: one device (index 0, `uuid`, `total` bytes) and
    one kernel whose processes are `pids`."""

    def __init__(self, pids: Sequence[int], total: int, uuid: str = UUID, kernel: str = KERNEL):
        self.pids, self.total, self.uuid, self.kernel = tuple(pids), total, uuid, kernel
        self.latest = Sample(state="starting")

    def sample_soon(self) -> None:
        pass

    def device_used_now(self, index: int) -> Optional[int]:
        return self.total - (FakeNvml.free(self.uuid) or 0)

    def take(self) -> Sample:
        usage = {pid: dict(per) for pid, per in FakeNvml.usage.items() if pid in self.pids}
        held = sum(per.get(self.uuid, 0) for per in usage.values())
        self.latest = Sample(
            state="ok",
            time=datetime.datetime.now().timestamp(),
            devices={0: DeviceReading(0, self.device_used_now(0))},
            kernels={self.kernel: {0: held}} if held else {},
            pids={self.kernel: tuple(sorted(usage))} if usage else {},
        )
        return self.latest


# --- the ledger -------------------------------------------------------------------------------------------------


def grant(kernel_id: str, caps: Mapping[int, int]) -> Grant:
    """A kernel's grant of `caps` (device index -> bytes), as policy gave it at start."""
    return Grant(
        kernel_id=kernel_id, user="alice", kernelspec="python3", devices=tuple(caps), caps=dict(caps),
        policy_caps=dict(caps), max_caps=dict(caps), source="default", placed=False,
    )


class Grants(HeldGrants):
    """A ledger's reads (get, grants) over the grants given; the parker reads nothing else of its ledger."""

    def __init__(self, grants: Iterable[Grant] = ()):
        self._grants = {one.kernel_id: one for one in grants}
        self._lock = threading.Lock()


# --- the kernel's client of the server ---------------------------------------------------------------------------


class OfflineClient(QuotaClient):
    """A kernel's client that sends nothing: a fake says what it answers by overriding the methods, and whatever it
    does not override fails as a request that found no server would (OSError, which the client turns into "no
    answer")."""

    def __init__(self):
        super().__init__("http://127.0.0.1:9/", KERNEL, "no-token")

    def _send(self, method: str, url: str, body: Optional[dict], timeout: float):
        raise OSError(f"a fake client sends nothing ({method} {url})")


# --- a parker on an event loop of its own -----------------------------------------------------------------------


class ParkerOnALoop:
    """A mixin for a test's harness: `start` runs the parker on a loop of the harness's own and hands it a first
    sample from `monitor`; each step then runs until the parker's tasks are done (`settle`)."""

    loop: asyncio.AbstractEventLoop
    parker: Parker
    monitor: NvmlMonitor

    def start(self) -> None:
        async def start():
            self.parker.start()
            await self.parker.ready()
            self.parker.on_sample(self.monitor.take())

        self.run(start())

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def settle(self) -> None:
        async def settle():
            for _ in range(20):  # a step's effects may start more (a park done asks the broker, which resumes)
                if not self.parker._tasks:
                    return
                await asyncio.gather(*list(self.parker._tasks), return_exceptions=True)

        self.run(settle())

    def deliver(self, call: Callable[[], Any]) -> None:
        """`call` on the loop (as jupyter_server's callbacks and the monitor's samples come), then settled."""

        async def on_loop():
            call()

        self.run(on_loop())
        self.settle()

    def sample(self) -> None:
        self.deliver(lambda: self.parker.on_sample(self.monitor.take()))

    def close(self) -> None:
        self.run(self.parker.stop())
        self.loop.close()
        FakeCheckpoint.reset()
        FakeNvml.reset()


# --- the check of a fake against what it stands in for ----------------------------------------------------------


def _interface_members(interface: type) -> Dict[str, Any]:
    """Public members the interface declares itself or through its bases (methods, properties, annotations)."""
    members: Dict[str, Any] = {}
    for cls in reversed(interface.__mro__):
        if cls in (object, typing.Protocol, typing.Generic):
            continue
        members.update({name: None for name in getattr(cls, "__annotations__", {})})
        members.update(vars(cls))
    return {name: member for name, member in members.items() if not name.startswith("_")}


def differences(fake: object, interface: type, whole: Optional[bool] = None) -> List[str]:
    """Where `fake` (an instance) does not answer as `interface` does; empty: it fits. `whole` (by default: for a
    Protocol) asks for every member of the interface, each the fake's own rather than the Protocol's empty one;
    otherwise only the members the fake has are compared. A method must take the same parameters (names and kinds)
    and be async where the interface's is."""
    found = []
    whole = getattr(interface, "_is_protocol", False) if whole is None else whole
    for name, member in _interface_members(interface).items():
        owner = next((cls for cls in type(fake).__mro__ if name in vars(cls)), None)
        from_interface = owner is not None and getattr(owner, "_is_protocol", False) and owner in interface.__mro__
        if (owner is None and not hasattr(fake, name)) or from_interface:
            if whole:
                found.append(f"{name}: missing")
            continue
        if owner in interface.__mro__ or not callable(member) or isinstance(member, type):
            continue  # the interface's own (a class's method the fake inherits), or not a method
        own = inspect.getattr_static(fake, name)
        if inspect.iscoroutinefunction(member) != inspect.iscoroutinefunction(own):
            found.append(f"{name}: async in one of them only")
        wanted, given = inspect.signature(member), inspect.signature(own)
        if _shape(wanted) != _shape(given):
            found.append(f"{name}: takes {_unannotated(given)}, the interface {_unannotated(wanted)}")
    return found


def _shape(signature: inspect.Signature) -> List[Tuple[str, Any]]:
    return [(parameter.name, parameter.kind) for parameter in signature.parameters.values()]


def _unannotated(signature: inspect.Signature) -> str:
    return str(signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                                 return_annotation=signature.empty))
