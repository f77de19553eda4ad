"""A day of notebook use replayed against a simulated H200 and the real broker: how many kernels one GPU carries
when idle kernels park, what a cell waits for its parked kernel, compared with overcommit 1 and no parking.

Nothing here runs on a GPU. The device, the host and the users are simulated; the decisions are the project's
own: admission by the real ledger (ledger/local.py), the idle timer and the host guard of parking/decisions.py,
every broker round by parking/broker.plan, and the check right before a restore by parker.room_right_now. The
simulation drives them as the server's parker does:
  - the parker samples every second; while a kernel waits for room (or a restore's reservation is held) the
    broker is asked on every sample; otherwise the clock jumps to the next event;
  - a park takes 0.3 s + bytes / 2.2 GB/s and a restore 0.3 s + bytes / 5 GB/s (measured on an H200 on
    2026-11-29..12-01, docs/measurements.md: 2 GiB parked in 1.3 s and restored in 0.7 s, 20 GiB in 9-11 s and
    3.9 s; a 56 GiB park took 33-55 s, slower than this model, but no kernel here holds more than 35 GiB);
  - a park frees device memory only when it is done; a restore takes its bytes on the device from its start and
    keeps its reservation until the first sample after it ended (the parker's `room_until`);
  - a kernel that turns busy while parked waits; the broker parks idle kernels (idle >= park_min_idle, least
    recently active first, within host memory) to make room; at park_wait_limit the kernel is told and its cell
    ends (it stays parked; the user's next cell asks again);
  - the idle timer (park_idle_after, 30 min here, as an admin would set it) parks kernels by itself; a park the
    host guard refuses is not tried again until the kernel has been busy (as in the parker);
  - a kernel's first cell allocates its working set; with overcommit and no admission control the device may
    physically lack it then (the parker makes no room for running kernels): that cell fails with an OOM and the
    user tries again at their next cell. Counted, never hidden.

Policies, on the same users (the same seeds: each user's day is drawn from the seed and the user's number
alone, so both policies and every N see the same people):
  (a) overcommit 1, no parking: a kernel is admitted while the caps fit the device, the rest refused; a refused
      user tries again every 10 minutes while at work;
  (b) parking and the broker, no admission limit (overcommit off), park_min_idle 60 s, park_wait_limit 300 s
      (the server's defaults), park_idle_after 30 min.

The users (parameters in Behaviour; all of them are printed and saved):
  - the day is 08:00-20:00; users arrive uniformly between 08:00 and 10:30 and stay lognormal(median 6.5 h,
    sigma 0.3); 30 % leave their kernel open when they go (it idles until 20:00);
  - each user runs one kernel; its working set (GPU memory it holds from its first cell on, CUDA context
    included) is lognormal(median 12 GiB, sigma 0.8), at least 1 GiB and at most 98 % of the cap;
    every kernel's cap is the admin's default, 0.25 of the device (35.9 GiB);
  - the kernel alternates active periods (cells touching the GPU) lognormal(median 90 s, sigma 1.2, 5 s..1 h)
    and idle periods lognormal(median 5 min, sigma 1.5, 10 s..3 h): heavy-tailed, most of the idle time in
    long gaps; while at work about 18 % of a kernel's time is active (printed with each run).
Contrasts (3 seeds, fewer numbers of users) say what limits the count: the same users with 512 GiB of host
memory, with each kernel's cap fitted to its working set (1.25 x, as a user would ask with %gpucap), and both.

Sources for the shape (read 2026-12; no study found gives the distribution of idle gaps within notebook
sessions, so the parameters above are this script's assumption, chosen to match what they report):
  - Carver et al., "NotebookOS: A Replicated Notebook Platform for Interactive Training with On-Demand GPUs",
    ASPLOS 2026, arXiv:2503.20591 (Adobe's production notebook trace): notebook sessions are long-running with
    intermittent, sporadic GPU use, and "during most of their lifetimes" do not use their reserved GPUs; task
    inter-arrival times are relatively high.
  - Li et al., "Analyzing Resource Utilization in an HPC System: A Case Study of NERSC's Perlmutter",
    ISC 2023: about half of the GPU jobs used at most 25 % of the GPU memory (working sets well below a GPU).
  - Cankur et al., "Characterizing Production GPU Workloads using System-wide Telemetry Data",
    arXiv:2502.18680: among jobs on 80 GB GPUs, 55 % peak at 50 % of HBM or less.
  - Weng et al., "MLaaS in the Wild", NSDI 2022, and its public Alibaba PAI trace: GPU instances hold memory
    while they compute little (a secondary analysis of the trace, affinode.io, reads a median lifetime-average
    compute utilisation of 1.5 %).

    python benchmarks/broker_day.py                # users 4..24, 5 seeds each, and the contrasts (2-3 minutes)
    python benchmarks/broker_day.py --quick        # 4, 8 and 12 users, one seed, a 4-hour day (seconds)
    python benchmarks/broker_day.py --save         # also writes benchmarks/results/broker_day-<date>-<host>.json
    python benchmarks/broker_day.py --schedule sched.json   # replay benchmarks/device_day.py's schedule (below)

Beside the device (`--schedule`): the seeded schedule of benchmarks/device_day.py (`--schedule-only` writes it)
replayed here with the device day's settings (caps, overcommit, park_idle_after, park_min_idle, park_wait_limit),
so that the simulation's cell-start delays and GPU-GiB-hours can be set beside the H200's. Each kernel is one
user present for the whole day: its first cell makes its working set, then its cells follow the schedule's gaps
(a wait shifts the user's later cells, as here everywhere; on the device the cells are sent at fixed times).
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_save_options, percentile, report  # noqa: E402

from gpu_quota_ext.devices import Device  # noqa: E402
from gpu_quota_ext.ledger import AdmissionRefused  # noqa: E402
from gpu_quota_ext.ledger.local import LocalLedger  # noqa: E402
from gpu_quota_ext.parking.broker import Demand, DeviceView, HostView, KernelView, Reservation, plan  # noqa: E402
from gpu_quota_ext.parking.decisions import ParkSettings, due_for_park  # noqa: E402
from gpu_quota_ext.parking.host_account import HostAccount, HostReading  # noqa: E402
from gpu_quota_ext.parking.parker import room_right_now  # noqa: E402
from gpu_quota_ext.policy import build_policy, resolve  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
H200_TOTAL = 143_771 * MiB  # one H200 as NVML counts it
FIGURES_FROM = "2026-11-29..2026-12-01"  # when the park and restore times were measured
HOUR = 3600.0
SOURCES = (
    "Carver et al., NotebookOS, ASPLOS 2026, arXiv:2503.20591: notebook sessions long-running, GPU use sporadic, "
    "reserved GPUs unused most of a session's life",
    "Li et al., Perlmutter resource utilization, ISC 2023: about half of GPU jobs use at most 25 % of GPU memory",
    "Cankur et al., arXiv:2502.18680: 55 % of jobs on 80 GB GPUs peak at 50 % of HBM or less",
    "Weng et al., MLaaS in the Wild, NSDI 2022 (Alibaba PAI trace): GPU memory held while compute is low",
    "no source gives the idle-gap distribution inside notebook sessions: lognormal, parameters assumed (Behaviour)",
)


@dataclass(frozen=True)
class Timings:
    """How long the driver takes, from the H200 measurements (park through the server, restore)."""

    park_fixed: float = 0.3
    park_rate: float = 2.2e9  # bytes/s
    restore_fixed: float = 0.3
    restore_rate: float = 5e9

    @classmethod
    def fast_park(cls) -> "Timings":
        """The fast park path through the server on the H200 (2026-12-04): the library's copy 53 / 50.6 GB/s, and
        about 0.45 s from the request to the state (fast_park_gpu-2026-12-04-h200.json, arena kept)."""
        return cls(park_fixed=0.45, park_rate=53e9, restore_fixed=0.45, restore_rate=50.6e9)

    def park_s(self, nbytes: int) -> float:
        return self.park_fixed + nbytes / self.park_rate

    def restore_s(self, nbytes: int) -> float:
        return self.restore_fixed + nbytes / self.restore_rate


@dataclass(frozen=True)
class Behaviour:
    """How the simulated users work (see the docstring for why these numbers)."""

    day_s: float = 12 * HOUR  # 08:00-20:00
    arrive_within_s: float = 2.5 * HOUR
    stay_median_s: float = 6.5 * HOUR
    stay_sigma: float = 0.3
    left_open: float = 0.3  # share of users who leave their kernel running when they go
    working_set_median: int = 12 * GiB
    working_set_sigma: float = 0.8
    working_set_min: int = GiB
    active_median_s: float = 90.0
    active_sigma: float = 1.2
    active_range_s: Tuple[float, float] = (5.0, HOUR)
    idle_median_s: float = 300.0
    idle_sigma: float = 1.5
    idle_range_s: Tuple[float, float] = (10.0, 3 * HOUR)


@dataclass(frozen=True)
class Machine:
    """The simulated host: one H200, the host's memory and what else uses it."""

    total: int = H200_TOTAL
    cap_fraction: float = 0.25  # the admin's default_cap (= max_cap)
    host_total: int = 128 * GiB
    host_base: int = 4 * GiB  # the system and the server
    host_per_kernel: int = GiB  # each kernel process's own host memory (Python, torch's CPU side)
    fitted_caps: Optional[float] = None  # each kernel's cap = this x its working set (a user's %gpucap), at most
    # the default cap; None: every kernel gets the default cap

    @property
    def cap(self) -> int:
        return int(self.total * self.cap_fraction)

    def caps_rule(self, days: Sequence[UserDay]):
        """The ledger's `caps` setting: None (the default cap for all), or a callable giving each user a cap
        fitted to their working set."""
        if self.fitted_caps is None:
            return None
        working = {d.user: d.working_set for d in days}
        factor, most = self.fitted_caps, self.cap
        return lambda user, kernelspec: int(min(most, max(GiB, working[user] * factor)))


@dataclass(frozen=True)
class PolicySpec:
    name: str
    overcommit: Optional[float]  # the ledger's; None: no admission control
    parking: bool
    idle_after: Optional[float] = None  # park_idle_after, seconds
    retry_s: float = 600.0  # a refused user starts again this much later


NO_PARKING = PolicySpec("overcommit 1, no parking", overcommit=1.0, parking=False)
PARKING = PolicySpec("parking + broker", overcommit=None, parking=True, idle_after=30 * 60.0)
POLICIES = (NO_PARKING, PARKING)


@dataclass(frozen=True)
class UserDay:
    user: str
    arrive: float  # seconds after 08:00
    depart: float  # no cell begins after this
    shutdown: float  # the kernel ends: at depart, or at the day's end when left open
    working_set: int
    periods: Tuple[Tuple[float, float], ...]  # (active seconds, idle seconds after it), in order


def _lognormal(rng: random.Random, median: float, sigma: float, low: float, high: float) -> float:
    return min(high, max(low, rng.lognormvariate(math.log(median), sigma)))


def draw_user(index: int, seed: int, behaviour: Behaviour, cap: int) -> UserDay:
    """User `index`'s day under `seed`: the same whatever the number of users or the policy."""
    rng = random.Random(f"broker-day/{seed}/{index}")
    arrive = rng.uniform(0, behaviour.arrive_within_s)
    depart = min(behaviour.day_s, arrive + rng.lognormvariate(math.log(behaviour.stay_median_s), behaviour.stay_sigma))
    shutdown = behaviour.day_s if rng.random() < behaviour.left_open else depart
    working_set = int(
        _lognormal(
            rng, behaviour.working_set_median, behaviour.working_set_sigma, behaviour.working_set_min, 0.98 * cap
        )
    )
    periods: List[Tuple[float, float]] = []
    span = 0.0
    while span < behaviour.day_s:  # enough for a whole day even when waits shift the user's cells later
        active = _lognormal(rng, behaviour.active_median_s, behaviour.active_sigma, *behaviour.active_range_s)
        idle = _lognormal(rng, behaviour.idle_median_s, behaviour.idle_sigma, *behaviour.idle_range_s)
        periods.append((active, idle))
        span += active + idle
    return UserDay(f"u{index:02d}", arrive, depart, shutdown, working_set, tuple(periods))


def draw_day(users: int, seed: int, behaviour: Behaviour, machine: Machine) -> Tuple[UserDay, ...]:
    return tuple(draw_user(i, seed, behaviour, machine.cap) for i in range(users))


def stream_digest(days: Sequence[UserDay]) -> str:
    """A fingerprint of the users' days: equal digests, same stream."""
    return hashlib.sha256(repr(days).encode()).hexdigest()[:16]


def active_share(days: Sequence[UserDay]) -> float:
    """The share of time at work that the drawn periods are active (before any wait shifts them)."""
    active = total = 0.0
    for day in days:
        clock = day.arrive
        for busy, idle in day.periods:
            if clock >= day.depart:
                break
            busy = min(busy, day.depart - clock)
            active += busy
            total += busy + min(idle, max(0.0, day.depart - clock - busy))
            clock += busy + idle
    return active / total if total else 0.0


# --- the simulation -----------------------------------------------------------------------------------------


@dataclass
class Kernel:
    day: UserDay
    cap: int = 0
    state: str = "off"  # off, busy, idle, parking, parked, waiting, resuming, gone
    used: int = 0  # on the device: busy, idle, parking (until done), resuming (from its start)
    host: int = 0  # its GPU bytes on the host: parked, waiting, resuming (until done)
    period: int = 0  # the next (active, idle) pair of its day
    last_active: float = 0.0
    refused: bool = False  # its last park was refused: not again until it has been busy
    cell_since: Optional[float] = None  # the cell that waits for its GPU state began then
    cell_wanted: bool = False  # a cell began while it was parking
    demand_since: Optional[float] = None
    room: int = 0  # bytes reserved for its restore
    room_until: Optional[float] = None  # ... until a sample after this
    token: int = 0  # events carrying an older token are stale

    @property
    def kernel_id(self) -> str:
        return self.day.user


@dataclass
class Outcome:
    """One policy's day. Waits are the seconds a cell waited because its kernel was parked."""

    policy: str
    users: int
    seed: int
    stream: str
    admitted: int = 0  # users who got a kernel that day
    peak_kernels: int = 0  # kernels alive at once, at most
    refusals: int = 0  # admission refusals (every try)
    refused_user_hours: float = 0.0  # hours users spent at work without a kernel
    cells: int = 0  # active periods begun
    wait_began: int = 0  # cells that found their kernel parked (or parking)
    waits: List[float] = field(default_factory=list)  # served waits and told waits alike
    served: int = 0
    told: int = 0
    ended: int = 0  # waits ended by the kernel's shutdown
    first_cell_ooms: int = 0
    broker_parks: int = 0
    timer_parks: int = 0
    host_refusals: int = 0  # parks the host guard refused
    restores: int = 0
    deferred: int = 0  # restores the last check (room_right_now) called off
    returned_gib_h: float = 0.0  # GPU memory on the host instead of the device (parked kernels)
    idle_held_gib_h: float = 0.0  # GPU memory held on the device by idle kernels
    busy_held_gib_h: float = 0.0
    host_peak: int = 0  # bytes held on the host by parked (and parking) kernels, at most
    device_peak: int = 0  # bytes used on the device, at most
    violations: List[str] = field(default_factory=list)  # broken invariants (tests assert none)
    day_s: float = 0.0

    @property
    def waited(self) -> int:
        return len(self.waits)

    def summary(self) -> dict:
        hours = self.day_s / HOUR
        return {
            "policy": self.policy,
            "users": self.users,
            "seed": self.seed,
            "stream": self.stream,
            "admitted": self.admitted,
            "peak_kernels": self.peak_kernels,
            "refusals": self.refusals,
            "refused_user_hours": round(self.refused_user_hours, 2),
            "cells": self.cells,
            "cells_waited": self.waited,
            "served": self.served,
            "told": self.told,
            "ended_by_shutdown": self.ended,
            "first_cell_ooms": self.first_cell_ooms,
            "broker_parks": self.broker_parks,
            "timer_parks": self.timer_parks,
            "host_refusals": self.host_refusals,
            "restores": self.restores,
            "deferred_restores": self.deferred,
            "parks_per_hour": round((self.broker_parks + self.timer_parks) / hours, 2),
            "restores_per_hour": round(self.restores / hours, 2),
            "returned_gib_h": round(self.returned_gib_h, 1),
            "idle_held_gib_h": round(self.idle_held_gib_h, 1),
            "busy_held_gib_h": round(self.busy_held_gib_h, 1),
            "host_peak_gib": round(self.host_peak / GiB, 1),
            "device_peak_gib": round(self.device_peak / GiB, 1),
            "violations": list(self.violations),
        }


class DaySim:
    """One policy, one day, one simulated GPU."""

    def __init__(
        self,
        days: Sequence[UserDay],
        policy: PolicySpec,
        seed: int = 0,
        behaviour: Behaviour = Behaviour(),
        machine: Machine = Machine(),
        timings: Timings = Timings(),
        park: Optional[ParkSettings] = None,
    ):
        self.policy = policy
        self.behaviour = behaviour
        self.machine = machine
        self.timings = timings
        self.park = park or ParkSettings(idle_after=policy.idle_after)
        self.settings = self.park.broker
        cap = f"{machine.cap_fraction}"
        rule = machine.caps_rule(days)
        rules = {} if rule is None else {"caps": rule}
        self.quota = build_policy(cap, cap, overcommit=policy.overcommit, on_full="refuse", **rules)
        self.ledger = LocalLedger([Device(0, "GPU 0", "GPU-simulated", machine.total, 0)], self.quota)
        self.kernels = {d.user: Kernel(d) for d in days}
        self.out = Outcome(policy.name, len(days), seed, stream_digest(days), day_s=behaviour.day_s)
        self.events: List[Tuple[float, int, str, str, int]] = []
        self.seq = 0
        self.clock = 0.0
        self.admitted_at: Dict[str, float] = {}

    # --- the world ------------------------------------------------------------------------------------

    def push(self, when: float, kind: str, kernel: Kernel) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, kernel.kernel_id, kernel.token))

    def live(self) -> List[Kernel]:
        return [k for k in self.kernels.values() if k.state not in ("off", "gone")]

    def device_used(self) -> int:
        """What NVML would show: every kernel whose memory is on the device."""
        return sum(k.used for k in self.kernels.values() if k.state in ("busy", "idle", "parking", "resuming"))

    def host_parked(self, in_flight: bool) -> int:
        held = sum(k.host for k in self.kernels.values() if k.state in ("parked", "waiting", "resuming"))
        if in_flight:
            held += sum(k.used for k in self.kernels.values() if k.state == "parking")
        return held

    def host_available(self, in_flight: bool) -> int:
        """The host's available memory. The broker counts parks under way itself (in_flight False); the
        parker's host guard reads the host as it is, a park under way counted whole (in_flight True)."""
        m = self.machine
        return m.host_total - m.host_base - m.host_per_kernel * len(self.live()) - self.host_parked(in_flight)

    def advance(self, to: float) -> None:
        """Integrate what is held where from the last change to `to`."""
        dt = to - self.clock
        if dt > 0:
            hours = dt / HOUR
            kernels = self.kernels.values()
            self.out.returned_gib_h += hours * sum(k.host for k in kernels if k.state in ("parked", "waiting")) / GiB
            self.out.idle_held_gib_h += hours * sum(k.used for k in kernels if k.state == "idle") / GiB
            self.out.busy_held_gib_h += hours * sum(k.used for k in kernels if k.state == "busy") / GiB
            self.clock = to

    def note_peaks(self) -> None:
        used = self.device_used()
        self.out.device_peak = max(self.out.device_peak, used)
        self.out.host_peak = max(self.out.host_peak, self.host_parked(in_flight=True))
        self.out.peak_kernels = max(self.out.peak_kernels, len(self.live()))
        if used > self.machine.total:
            self.out.violations.append(f"{self.clock:.0f} s: the device holds {used} B of {self.machine.total}")

    # --- the users ------------------------------------------------------------------------------------

    def arrive(self, k: Kernel, now: float) -> None:
        if now >= k.day.depart:
            return
        try:
            grant = self.ledger.grant(k.kernel_id, k.kernel_id, "python3", resolve(self.quota, k.kernel_id, "python3"))
        except AdmissionRefused:
            self.out.refusals += 1
            if now + self.policy.retry_s < k.day.depart:
                self.push(now + self.policy.retry_s, "arrive", k)
            else:
                self.out.refused_user_hours += (k.day.depart - k.day.arrive) / HOUR
            return
        self.out.admitted += 1
        self.out.refused_user_hours += (now - k.day.arrive) / HOUR
        self.admitted_at[k.kernel_id] = now
        k.cap = grant.caps[0]
        k.state, k.used, k.last_active = "idle", 0, now
        self.push(now, "cell", k)
        self.push(k.day.shutdown, "shutdown", k)

    def next_cell(self, k: Kernel, now: float) -> None:
        """The current period's idle gap begins: its next cell, if the user is still at work then."""
        gap = k.day.periods[k.period][1] if k.period < len(k.day.periods) else math.inf
        k.period += 1
        if now + gap < k.day.depart and k.period < len(k.day.periods):
            self.push(now + gap, "cell", k)

    def cell(self, k: Kernel, now: float) -> None:
        self.out.cells += 1
        k.refused = False  # it has been busy: the idle timer may try it again later
        if k.state == "idle":
            if k.used == 0:  # its first cell allocates its working set
                if self.device_used() + k.day.working_set > self.machine.total:
                    self.out.first_cell_ooms += 1
                    k.last_active = now
                    self.next_cell(k, now)
                    return
                k.used = k.day.working_set
            self.run_cell(k, now)
        elif k.state == "parked":
            self.out.wait_began += 1
            k.state, k.cell_since, k.demand_since = "waiting", now, now
        elif k.state == "parking":
            self.out.wait_began += 1
            k.cell_wanted, k.cell_since = True, now
        else:
            self.out.violations.append(f"{now:.0f} s: {k.kernel_id} began a cell while {k.state}")

    def run_cell(self, k: Kernel, now: float) -> None:
        k.state = "busy"
        self.push(now + k.day.periods[k.period][0], "rest", k)

    def rest(self, k: Kernel, now: float) -> None:
        k.state, k.last_active = "idle", now
        self.next_cell(k, now)

    def shutdown(self, k: Kernel, now: float) -> None:
        if k.state == "waiting" or (k.state == "parking" and k.cell_wanted):
            self.out.ended += 1
            self.out.waits.append(now - (k.cell_since if k.cell_since is not None else now))
        k.state, k.used, k.host, k.room, k.room_until = "gone", 0, 0, 0, None
        k.token += 1
        self.ledger.release(k.kernel_id)

    # --- the driver ------------------------------------------------------------------------------------

    def start_park(self, k: Kernel, now: float, why: str) -> bool:
        """The parker's park: the host account on a fresh reading (parks under way counted whole: the simulation
        lands a park's bytes all at once, at its end), then the checkpoint (done after park_s)."""
        reading = HostReading(self.host_available(in_flight=True))
        refused = HostAccount().refusal(k.kernel_id, k.used, reading, self.park.host_margin)
        if refused is not None:
            k.refused = True
            self.out.host_refusals += 1
            return False
        k.state, k.cell_wanted = "parking", False
        if why == "broker":
            self.out.broker_parks += 1
        else:
            self.out.timer_parks += 1
        self.push(now + self.timings.park_s(k.used), "parked", k)
        return True

    def parked(self, k: Kernel, now: float) -> None:
        k.state, k.host, k.used = "parked", k.used, 0
        if k.cell_wanted:  # a cell began while it was parking: it asks for room now
            k.state, k.demand_since, k.cell_wanted = "waiting", now, False

    def start_restore(self, k: Kernel, now: float) -> None:
        # Restores granted and not yet seen: none here, where a restore's bytes are on the device (in every
        # reading) from its start; the parker counts those its last NVML reading may not show yet.
        others = {0: 0}
        short = room_right_now(
            {0: k.host}, {0: self.machine.total}, lambda index: self.device_used(), others, self.park.device_margin
        )
        if short is not None:
            self.out.deferred += 1  # the broker's word was wrong: never expected here (every reading is exact)
            self.out.violations.append(f"{now:.0f} s: restore of {k.kernel_id} called off: {short}")
            return
        if self.device_used() + k.host > self.machine.total:
            self.out.violations.append(f"{now:.0f} s: restore of {k.kernel_id} into a full device")
        limit = self.settings.wait_limit
        if limit is not None and k.demand_since is not None and now - k.demand_since > limit + 1.0:
            self.out.violations.append(f"{now:.0f} s: {k.kernel_id} was given room after its wait limit")
        k.state, k.used, k.room, k.room_until, k.demand_since = "resuming", k.host, k.host, None, None
        self.out.restores += 1
        self.push(now + self.timings.restore_s(k.host), "resumed", k)

    def resumed(self, k: Kernel, now: float) -> None:
        k.host, k.room_until = 0, now
        self.out.served += 1
        wait = now - (k.cell_since if k.cell_since is not None else now)
        self.out.waits.append(wait)
        k.cell_since = None
        self.run_cell(k, now)

    # --- the parker's sample: reservations, the idle timer, the broker ------------------------------------

    def sample(self, now: float) -> None:
        for k in self.kernels.values():
            if k.room_until is not None and now > k.room_until:
                k.room, k.room_until = 0, None
        if not self.policy.parking:
            return
        for k in self.live():
            if k.state == "idle" and k.used > 0 and not k.refused:
                if due_for_park(self.park, "idle", now - k.last_active):
                    self.start_park(k, now, "timer")
        if any(k.state == "waiting" for k in self.kernels.values()):
            self.decide(now)

    def view(self, now: float) -> Tuple[List[KernelView], List[Demand], List[Reservation]]:
        views, demands, reservations = [], [], []
        for k in self.live():
            on_device = k.state in ("busy", "idle", "parking", "resuming") and k.used > 0
            views.append(
                KernelView(
                    kernel_id=k.kernel_id,
                    state=k.state,
                    used={0: k.used} if on_device else {},
                    caps={0: k.cap},
                    idle_for=now - k.last_active if k.state == "idle" else None,
                    parkable=k.state == "idle" and k.used > 0 and not k.refused,
                    label=f"kernel {k.kernel_id}",
                )
            )
            if k.state == "waiting":
                demands.append(Demand(k.kernel_id, {0: k.host}, k.demand_since if k.demand_since is not None else now))
            if k.room:
                reservations.append(Reservation(k.kernel_id, {0: k.room}))
        return views, demands, reservations

    def decide(self, now: float) -> None:
        views, demands, reservations = self.view(now)
        device = DeviceView(0, "GPU 0", self.machine.total, self.device_used())
        host = HostView(available=self.host_available(in_flight=False))
        decided = plan([device], views, demands, reservations, host, self.settings, now)
        for victim, _ in decided.park:
            k = self.kernels[victim]
            if k.state == "idle":
                self.start_park(k, now, "broker")
        for kernel_id in decided.go:
            k = self.kernels[kernel_id]
            if k.state == "waiting":
                self.start_restore(k, now)
        for kernel_id in decided.told:
            k = self.kernels[kernel_id]
            if k.state == "waiting":  # the kernel side ends the cell at the limit: parked, the next cell asks again
                self.out.told += 1
                self.out.waits.append(now - (k.cell_since if k.cell_since is not None else now))
                k.state, k.cell_since, k.demand_since = "parked", None, None
                self.next_cell(k, now)

    # --- the clock -------------------------------------------------------------------------------------

    def next_tick(self, now: int) -> Optional[int]:
        """The next sample that matters: every second while someone waits or a reservation is held, else the
        sample at or after the next event or idle-timer deadline."""
        if any(k.state == "waiting" or k.room for k in self.kernels.values()):
            return now + 1
        times = [self.events[0][0]] if self.events else []
        if self.policy.parking and self.park.idle_after is not None:
            times += [
                k.last_active + self.park.idle_after
                for k in self.kernels.values()
                if k.state == "idle" and k.used > 0 and not k.refused
            ]
        if not times:
            return None
        return max(now + 1, math.ceil(min(times)))

    def run(self) -> Outcome:
        for k in self.kernels.values():
            self.push(k.day.arrive, "arrive", k)
        handlers = {
            "arrive": self.arrive,
            "cell": self.cell,
            "rest": self.rest,
            "shutdown": self.shutdown,
            "parked": self.parked,
            "resumed": self.resumed,
        }
        now = 0
        end = self.behaviour.day_s
        while True:
            tick = self.next_tick(now)
            if tick is None or tick > end:
                break
            while self.events and self.events[0][0] <= tick:
                when, _, kind, kernel_id, token = heapq.heappop(self.events)
                k = self.kernels[kernel_id]
                if token != k.token:
                    continue
                self.advance(when)
                handlers[kind](k, when)
                self.note_peaks()
            self.advance(tick)
            now = tick
            self.sample(now)
            self.note_peaks()
        self.advance(end)
        for k in self.live():
            self.shutdown(k, end)
        self.check()
        return self.out

    def check(self) -> None:
        out = self.out
        if not out.wait_began == out.waited == out.served + out.told + out.ended:
            out.violations.append(
                f"{out.wait_began} cells waited; {out.waited} waits ended: served {out.served} + told {out.told} "
                f"+ ended by shutdown {out.ended}"
            )
        if not self.policy.parking and (out.waited or out.broker_parks or out.timer_parks):
            out.violations.append("a policy without parking parked or waited")


def run_day(
    users: int,
    seed: int,
    policies: Sequence[PolicySpec] = POLICIES,
    behaviour: Behaviour = Behaviour(),
    machine: Machine = Machine(),
    timings: Timings = Timings(),
) -> List[Outcome]:
    """Every policy on the same users' day."""
    days = draw_day(users, seed, behaviour, machine)
    return [DaySim(days, p, seed, behaviour, machine, timings).run() for p in policies]


# --- the device day's schedule, replayed ------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplaySettings:
    """benchmarks/device_day.py's settings, by default its own defaults."""

    overcommit: float = 3.0
    idle_after: float = 30.0  # park_idle_after, seconds
    min_idle: float = 10.0  # park_min_idle, seconds
    wait_limit: float = 300.0  # park_wait_limit, seconds
    tail_s: float = 300.0  # the day runs this long past the schedule's last minute, for the last cells to end


def schedule_days(schedule: dict, total: int = H200_TOTAL) -> Tuple[UserDay, ...]:
    """device_day's schedule (its JSON: seed, minutes, cap, kernels with cells, work and working_set) as users'
    days: one user per kernel, arriving at its first cell, its periods the cells' work and the gaps between."""
    days = []
    end = schedule["minutes"] * 60
    for plan_ in schedule["kernels"]:
        cells, work = plan_["cells"], plan_["work"]
        periods = []
        for index, (at, busy) in enumerate(zip(cells, work)):
            following = cells[index + 1] if index + 1 < len(cells) else end + HOUR
            periods.append((float(busy), max(0.0, following - at - busy)))
        days.append(
            UserDay(plan_["name"], float(cells[0]), end, end + HOUR, int(plan_["working_set"] * total), tuple(periods))
        )
    return tuple(days)


def replay(
    schedule: dict,
    settings: ReplaySettings = ReplaySettings(),
    timings: Timings = Timings(),
    machine: Optional[Machine] = None,
) -> dict:
    """The device day's schedule through the simulation, in device_day's units: cell-start delay (a cell that
    found its kernel on the device starts at once here: 0 s), GPU-GiB-hours held by idle kernels and returned,
    host memory's lowest point, and what the simulation counts instead of lost kernels (violations, first-cell
    OOMs: it cannot lose a process)."""
    machine = machine or Machine(cap_fraction=float(schedule["cap"]))
    days = schedule_days(schedule, machine.total)
    behaviour = Behaviour(day_s=schedule["minutes"] * 60 + settings.tail_s)
    policy = PolicySpec(
        "device day replay", overcommit=settings.overcommit, parking=True, idle_after=settings.idle_after
    )
    park = ParkSettings(idle_after=settings.idle_after, min_idle=settings.min_idle, wait_limit=settings.wait_limit)
    out = DaySim(days, policy, schedule["seed"], behaviour, machine, timings, park).run()
    delays = list(out.waits) + [0.0] * max(0, out.cells - out.waited)
    host_lowest = machine.host_total - machine.host_base - machine.host_per_kernel * len(days) - out.host_peak
    return {
        "device": f"simulated H200, figures from {FIGURES_FROM}",
        "schedule_seed": schedule["seed"],
        "settings": asdict(settings),
        "timings": asdict(timings),
        "cells": out.cells,
        "cell_start_delay_s": {
            "p50": round(percentile(delays, 0.50), 2),
            "p95": round(percentile(delays, 0.95), 2),
            "p99": round(percentile(delays, 0.99), 2),
            "worst": round(max(delays), 2) if delays else None,
        },
        "cells_waited": out.waited,
        "gpu_gib_hours_held_by_idle_kernels": round(out.idle_held_gib_h, 3),
        "gpu_gib_hours_returned_by_parking": round(out.returned_gib_h, 3),
        "host_available_lowest_gib": round(host_lowest / GiB, 2),
        "first_cell_ooms": out.first_cell_ooms,
        "parks": {"timer": out.timer_parks, "broker": out.broker_parks, "host_refused": out.host_refusals},
        "restores": out.restores,
        "violations": list(out.violations),
    }


# --- the sweep and its table ----------------------------------------------------------------------------------


def aggregate(outcomes: Sequence[Outcome]) -> dict:
    """One (users, policy) row over its seeds: waits pooled, counts per day (the mean over seeds)."""
    runs = len(outcomes)
    waits = [w for o in outcomes for w in o.waits]

    def mean(name: str) -> float:
        return sum(getattr(o, name) for o in outcomes) / runs

    hours = outcomes[0].day_s / HOUR
    return {
        "policy": outcomes[0].policy,
        "users": outcomes[0].users,
        "seeds": [o.seed for o in outcomes],
        "admitted": mean("admitted"),
        "peak_kernels": max(o.peak_kernels for o in outcomes),
        "refused_user_hours": mean("refused_user_hours"),
        "cells": mean("cells"),
        "cells_waited": len(waits) / runs,
        "wait_p50_s": percentile(waits, 0.5) if waits else None,
        "wait_p95_s": percentile(waits, 0.95) if waits else None,
        "wait_max_s": max(waits) if waits else None,
        "told": mean("told"),
        "first_cell_ooms": mean("first_cell_ooms"),
        "returned_gib_h": mean("returned_gib_h"),
        "idle_held_gib_h": mean("idle_held_gib_h"),
        "parks_per_hour": (mean("broker_parks") + mean("timer_parks")) / hours,
        "broker_parks": mean("broker_parks"),
        "timer_parks": mean("timer_parks"),
        "restores_per_hour": mean("restores") / hours,
        "host_peak_gib": max(o.host_peak for o in outcomes) / GiB,
        "host_refusals": mean("host_refusals"),
        "violations": sum(len(o.violations) for o in outcomes),
        "runs": [o.summary() for o in outcomes],
    }


def largest_within(rows: Sequence[dict], target_s: float) -> Optional[int]:
    """The largest number of users whose parking row keeps its p95 wait within the target (every smaller number
    too: the first one past it ends the count)."""
    best = None
    for row in sorted((r for r in rows if r["policy"] == PARKING.name), key=lambda r: r["users"]):
        p95 = row["wait_p95_s"] or 0.0
        if p95 > target_s:
            break
        best = row["users"]
    return best


def fmt(value, digits=0) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}"


def table(rows: Sequence[dict]) -> str:
    head = (
        f"{'users':>5} {'policy':<24} {'admit':>5} {'peak':>4} {'no-k h':>6} {'cells':>5} {'waited':>6} {'p50 s':>6} "
        f"{'p95 s':>6} {'max s':>6} {'told':>5} {'OOM':>4} {'ret GiB-h':>9} {'idle GiB-h':>10} {'park/h':>6} "
        f"{'rest/h':>6} {'host pk':>7} {'host no':>7}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['users']:>5} {r['policy']:<24} {fmt(r['admitted'], 1):>5} {r['peak_kernels']:>4} "
            f"{fmt(r['refused_user_hours'], 1):>6} "
            f"{fmt(r['cells']):>5} {fmt(r['cells_waited'], 1):>6} {fmt(r['wait_p50_s'], 1):>6} "
            f"{fmt(r['wait_p95_s'], 1):>6} {fmt(r['wait_max_s']):>6} {fmt(r['told'], 1):>5} "
            f"{fmt(r['first_cell_ooms'], 1):>4} {fmt(r['returned_gib_h']):>9} {fmt(r['idle_held_gib_h']):>10} "
            f"{fmt(r['parks_per_hour'], 1):>6} {fmt(r['restores_per_hour'], 1):>6} {fmt(r['host_peak_gib']):>7} "
            f"{fmt(r['host_refusals'], 1):>7}"
        )
    return "\n".join(lines)


LEGEND = """admit: users who got a kernel (mean per day); peak: kernels alive at once (most, over seeds); no-k h: hours
users spent at work without a kernel, refused by admission (per day, all users together); cells: active
periods begun; waited: cells whose kernel was parked; p50/p95/max: their waits, pooled over seeds (a told cell
counts its wait to the limit); told: cells told at park_wait_limit; OOM: first cells that found the device
physically full; ret GiB-h: GPU memory-hours on the host instead of the device; idle GiB-h: memory-hours idle
kernels still held on the device; park/h, rest/h: parks (broker and idle timer) and restores per hour; host pk:
most host memory held by parked kernels (GiB); host no: parks the host guard refused (per day)."""


# What limits the count: the same users with more host memory, with caps fitted to the working sets, both.
CONTRASTS = (
    ("host 512 GiB", {"host_total": 512 * GiB}),
    ("caps 1.25 x working set", {"fitted_caps": 1.25}),
    ("both", {"host_total": 512 * GiB, "fitted_caps": 1.25}),
)


def sweep(
    users: Sequence[int], seeds: Sequence[int], behaviour: Behaviour, machine: Machine, timings: Timings, label: str
) -> List[dict]:
    rows = []
    began = time.perf_counter()
    for n in users:
        per_policy: Dict[str, List[Outcome]] = {p.name: [] for p in POLICIES}
        for seed in seeds:
            outcomes = run_day(n, seed, POLICIES, behaviour, machine, timings)
            assert len({o.stream for o in outcomes}) == 1, "the policies must see the same users"
            for o in outcomes:
                per_policy[o.policy].append(o)
        for p in POLICIES:
            rows.append({"scenario": label, **aggregate(per_policy[p.name])})
        print(f"{label}: {n} users done ({time.perf_counter() - began:.0f} s)", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", default="4,6,8,10,12,14,16,18,20,24", help="numbers of users, comma-separated")
    parser.add_argument("--seeds", type=int, default=5, help="days drawn per number of users (seeds 1..N)")
    parser.add_argument("--target", type=float, default=30.0, help="p95 wait target, seconds")
    parser.add_argument("--hours", type=float, default=12.0, help="length of the day (from 08:00)")
    parser.add_argument("--host-gib", type=float, default=128.0, help="the host's memory")
    parser.add_argument("--contrast-users", default="6,8,12,16,24", help="users for the contrasts ('' for none)")
    parser.add_argument("--contrast-seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="4, 8 and 12 users, one seed, a 4-hour day")
    parser.add_argument("--schedule", help="replay this device_day schedule (JSON of device_day.py --schedule-only)")
    parser.add_argument(
        "--fast-park", action="store_true", help="with --schedule: the fast park path's timings (Timings.fast_park)"
    )
    add_save_options(parser)
    options = parser.parse_args()
    if options.schedule:
        import json

        timings = Timings.fast_park() if options.fast_park else Timings()
        report(
            "broker_day_replay" + ("_fast_park" if options.fast_park else ""),
            replay(json.loads(Path(options.schedule).read_text()), timings=timings),
            save=options.save,
            out=options.out,
        )
        return
    users = [int(u) for u in options.users.split(",")]
    seeds = list(range(1, options.seeds + 1))
    contrast_users = [int(u) for u in options.contrast_users.split(",") if u.strip()]
    contrast_seeds = list(range(1, options.contrast_seeds + 1))
    hours = options.hours
    if options.quick:
        users, seeds, hours = [4, 8, 12], [1], 4.0
        contrast_users, contrast_seeds = [8], [1]
    behaviour = Behaviour(day_s=hours * HOUR, arrive_within_s=min(2.5 * HOUR, hours * HOUR / 4))
    if options.quick:
        behaviour = replace(behaviour, stay_median_s=3 * HOUR)
    machine = Machine(host_total=int(options.host_gib * GiB))
    timings = Timings()
    began = time.perf_counter()
    rows = sweep(users, seeds, behaviour, machine, timings, "measured")
    contrasts = []
    for label, changes in CONTRASTS if contrast_users else ():
        contrasts += sweep(contrast_users, contrast_seeds, behaviour, replace(machine, **changes), timings, label)
    elapsed = time.perf_counter() - began
    best = largest_within(rows, options.target)
    best_contrast = {
        label: largest_within([r for r in contrasts if r["scenario"] == label], options.target)
        for label, _ in CONTRASTS
    }
    days_run = (len(users) * len(seeds) + len(CONTRASTS) * len(contrast_users) * len(contrast_seeds)) * len(POLICIES)
    sample_days = [d for s in seeds for d in draw_day(max(users), s, behaviour, machine)]
    per_gpu = None if best is None else best * machine.cap_fraction

    def beside(scenario_rows: Sequence[dict], n: Optional[int]) -> str:
        plain = [r for r in scenario_rows if r["users"] == n and r["policy"] == NO_PARKING.name]
        if not plain:
            return ""
        admitted, peak = fmt(plain[0]["admitted"], 1), plain[0]["peak_kernels"]
        return f" (overcommit 1 on those users: {admitted} admitted, {peak} at once)"

    lines = [
        f"largest number of users whose p95 wait stays within {options.target:g} s, with parking: {best} on one GPU "
        f"(their caps add up to {fmt(per_gpu, 2)} of the device){beside(rows, best)}"
    ]
    for label, n in best_contrast.items():
        scenario_rows = [r for r in contrasts if r["scenario"] == label]
        lines.append(f"  {label} (of {','.join(map(str, contrast_users))} users): {fmt(n)}{beside(scenario_rows, n)}")
    lines.append(
        f"drawn users active {100 * active_share(sample_days):.0f} % of their time at work; "
        f"{days_run} simulated days in {elapsed:.0f} s"
    )
    summary = "\n".join(lines)
    figures = {
        "device": f"simulated H200, figures from {FIGURES_FROM}",
        "quick": options.quick,
        "target_p95_s": options.target,
        "largest_users_within_target": best,
        "caps_per_device_at_that": per_gpu,
        "kernels_at_overcommit_1": int(1 / machine.cap_fraction),
        "largest_users_within_target_contrasts": best_contrast,
        "active_share": active_share(sample_days),
        "sources": list(SOURCES),
        "seeds": seeds,
        "users": users,
        "contrast_seeds": contrast_seeds,
        "contrast_users": contrast_users,
        "parameters": {
            "behaviour": asdict(behaviour),
            "machine": asdict(machine),
            "contrasts": {label: changes for label, changes in CONTRASTS},
            "timings": asdict(timings),
            "park_settings": ParkSettings(idle_after=PARKING.idle_after).describe(),
            "policies": [asdict(p) for p in POLICIES],
        },
        "elapsed_s": elapsed,
        "rows": [{k: v for k, v in r.items() if k != "runs"} for r in rows + contrasts],
    }
    report("broker_day", figures, save=options.save, out=options.out)
    text = ["", "as measured (caps 0.25 of the device, 128 GiB host):", table(rows)]
    for label, _ in CONTRASTS if contrast_users else ():
        text += ["", f"{label}:", table([r for r in contrasts if r["scenario"] == label])]
    sources = ["sources of the users' model:"] + [f"  - {source}" for source in SOURCES]
    print("\n".join(text + ["", LEGEND, ""] + sources + ["", summary]))


if __name__ == "__main__":
    main()
