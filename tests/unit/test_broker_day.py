"""benchmarks/broker_day.py, the day of notebook use replayed against the real broker: its quick core on small
days, checked for what must hold whatever the timings: the policies see the same users, no restore runs into a
device without room for it, the device never holds more than it has, every cell that waited was served, told
at the limit or ended with its kernel, and the policy without parking never parks. Then the checks themselves:
a broker that grants every resume at once is caught."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gpu_quota_ext.parking.broker import Plan

ROOT = Path(__file__).resolve().parents[2]


def load():
    name = "broker_day"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "broker_day.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


day = load()
GiB = day.GiB
# Two hours, users who come within 20 minutes and think for two minutes between cells (median): small and busy.
SMALL = day.Behaviour(day_s=2 * 3600, arrive_within_s=1200, stay_median_s=1.5 * 3600, idle_median_s=120)
TIGHT_HOST = day.Machine(host_total=32 * GiB)  # the host guard refuses parks, so some cells are told


def outcomes(users, seed, machine=None):
    return day.run_day(users, seed, day.POLICIES, SMALL, machine or day.Machine())


@pytest.mark.parametrize("machine", [day.Machine(), TIGHT_HOST], ids=["128GiB-host", "32GiB-host"])
@pytest.mark.parametrize("seed", [1, 2])
def test_a_small_day_keeps_every_invariant(machine, seed):
    plain, parking = outcomes(10, seed, machine)
    assert plain.stream == parking.stream  # the same users, drawn from the seed alone
    for outcome in (plain, parking):
        assert outcome.violations == []
        assert outcome.device_peak <= machine.total
        assert outcome.deferred == 0  # the broker's room was there when the restore was asked
    # Every cell that found its kernel parked was served, told at the limit, or ended with its kernel.
    assert parking.wait_began == parking.served + parking.told + parking.ended == len(parking.waits)
    # Host memory: what parked kernels hold never passes what the host had for them.
    assert parking.host_peak + machine.host_base + machine.host_per_kernel <= machine.host_total
    # Overcommit 1 without parking: nobody waits or parks; its caps of 0.25 admit 4 kernels at once.
    assert plain.waits == [] and plain.broker_parks == plain.timer_parks == plain.restores == 0
    assert plain.peak_kernels <= 4 < parking.peak_kernels


def test_the_small_days_exercise_what_is_checked():
    """Not vacuous: across these days cells wait, the broker parks, kernels resume and some are told."""
    runs = [outcomes(10, seed, machine)[1] for seed in (1, 2) for machine in (day.Machine(), TIGHT_HOST)]
    assert sum(o.broker_parks for o in runs) > 0 and sum(o.timer_parks for o in runs) > 0
    assert sum(o.restores for o in runs) > 0 and sum(o.served for o in runs) > 0
    assert sum(o.told for o in runs) > 0 and sum(o.host_refusals for o in runs) > 0


def test_waits_end_by_the_limit():
    limit = day.ParkSettings().wait_limit
    timings = day.Timings()
    for seed in (1, 2):
        parking = outcomes(10, seed, TIGHT_HOST)[1]
        biggest_park = timings.park_s(day.Machine().cap)
        biggest_restore = timings.restore_s(day.Machine().cap)
        for wait in parking.waits:  # a cell may wait for its own park to end, then up to the limit, then a restore
            assert wait <= biggest_park + limit + 1 + biggest_restore


def test_every_number_of_users_and_policy_sees_the_same_people():
    machine = day.Machine()
    few, many = day.draw_day(4, 7, SMALL, machine), day.draw_day(12, 7, SMALL, machine)
    assert many[:4] == few
    assert day.draw_day(12, 7, SMALL, machine) == many
    assert day.draw_day(12, 8, SMALL, machine) != many
    assert len({o.stream for o in outcomes(6, 3)}) == 1


def test_a_broker_that_grants_every_resume_at_once_is_caught(monkeypatch):
    big = replace(SMALL, working_set_median=24 * GiB)  # working sets that fill the device
    days = day.draw_day(10, 1, big, day.Machine())
    assert day.DaySim(days, day.PARKING, 1, big).run().violations == []  # the real broker, this day

    def greedy(devices, kernels, demands, reservations, host, settings, now):
        return Plan(go=tuple(d.kernel_id for d in demands))

    monkeypatch.setattr(day, "plan", greedy)
    caught = day.DaySim(days, day.PARKING, 1, big).run()
    assert caught.deferred > 0
    assert any("called off" in v and "short of" in v for v in caught.violations), caught.violations[:3]


def test_the_quick_mode_prints_the_table(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["broker_day.py", "--quick"])
    day.main()
    printed = capsys.readouterr().out
    assert "parking + broker" in printed and "overcommit 1, no parking" in printed
    assert "largest number of users whose p95 wait stays within 30 s" in printed
    assert "not saved" in printed


# --- the device day's schedule, replayed (--schedule) ---------------------------------------------------------


def device_day_schedule():
    spec = importlib.util.spec_from_file_location("device_day", ROOT / "benchmarks" / "device_day.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("device_day", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    from dataclasses import asdict

    return asdict(module.schedule())


def test_the_device_days_schedule_becomes_one_user_per_kernel_with_its_cells_and_gaps():
    schedule = device_day_schedule()
    days = day.schedule_days(schedule)
    assert [d.user for d in days] == [k["name"] for k in schedule["kernels"]]
    for plan, user in zip(schedule["kernels"], days):
        assert user.arrive == plan["cells"][0]
        assert [busy for busy, _ in user.periods] == plan["work"]
        # Each cell's work and the gap after it add up to the next cell's time, as the schedule sends them.
        starts = [user.arrive]
        for busy, idle in user.periods[:-1]:
            starts.append(starts[-1] + busy + idle)
        assert starts == pytest.approx(plan["cells"])
        assert user.working_set == int(plan["working_set"] * day.H200_TOTAL)


def test_the_replayed_device_day_breaks_no_invariant_and_is_the_same_every_time():
    schedule = device_day_schedule()
    first, again = day.replay(schedule), day.replay(schedule)
    assert first == again
    assert first["violations"] == []
    assert 0 < first["cells_waited"] <= first["cells"] <= sum(len(k["cells"]) for k in schedule["kernels"])
    # No resume waits for the idle kernels' unused caps: with overcommit 3 they add up to more than the device
    # (three idle kernels of cap 0.35), so claiming them left every resume waiting its whole limit.
    assert first["cell_start_delay_s"]["p95"] < day.ReplaySettings().wait_limit
