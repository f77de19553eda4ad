"""What the parker tells the broker, and its last check before a restore, without a server: the round it builds
from the monitor's last sample, its records and the ledger, and `room_right_now`."""

import datetime
import os
from types import SimpleNamespace

from gpu_quota_ext.devices import Device
from gpu_quota_ext.parking import ParkSettings
from gpu_quota_ext.parking.fake_checkpoint import FakeCheckpoint
from gpu_quota_ext.parking.parker import Parker, room_right_now
from gpu_quota_ext.parking.states import ParkRecord
from gpu_quota_ext.usage import Sample
from gpu_quota_ext.usage.sampling import DeviceReading

from .fakes import Grants, ParkerKernels, StillMonitor, grant

GiB = 1 << 30
NOW = datetime.datetime.now(datetime.timezone.utc)


def parker_with(records, sample, states):
    parker = Parker(
        ParkSettings(),
        FakeCheckpoint(),
        ParkerKernels(states, idle_for=600),
        Grants(grant(k, {0: 40 * GiB}) for k in states),
        {0: Device(index=0, name="GPU", uuid="GPU-0", total=140 * GiB, nvml_index=0)},
        StillMonitor(sample),
        host=lambda: (None, None),
    )
    parker.driver_problem = None
    parker.records.update(records)
    return parker


def test_a_kernel_parked_after_the_sample_counts_as_a_park_under_way():
    # Its bytes are still in the reading: the broker must wait for them, not park a second kernel for them.
    sample = Sample(
        state="ok", time=1000.0, devices={0: DeviceReading(0, 56 * GiB)}, kernels={"B": {0: 56 * GiB}}, pids={}
    )
    parked_after = ParkRecord(state="parked", since=1001.0, parked={0: 56 * GiB}, pids=(7,))
    round_ = parker_with({"B": parked_after}, sample, {"B": "idle"}).round()
    (b,) = round_.kernels
    assert b.state == "parking" and b.used == {0: 56 * GiB}
    parked_before = ParkRecord(state="parked", since=999.0, parked={0: 56 * GiB}, pids=(7,))
    fresh = Sample(state="ok", time=1000.0, devices={0: DeviceReading(0, 0)}, kernels={}, pids={})
    (b,) = parker_with({"B": parked_before}, fresh, {"B": "idle"}).round().kernels
    assert b.state == "parked"


def test_a_waiting_kernel_is_a_demand_and_a_restore_under_way_a_reservation():
    sample = Sample(state="ok", time=1000.0, devices={0: DeviceReading(0, 0)}, kernels={}, pids={})
    records = {
        "A": ParkRecord(state="waiting", since=1.0, parked={0: 20 * GiB}, demand="cell", waiting_since=5.0),
        "C": ParkRecord(state="resuming", since=1.0, parked={0: 8 * GiB}, room={0: 8 * GiB}, demand="cell",
                        waiting_since=3.0),
        "D": ParkRecord(state="waiting", since=1.0, parked={0: GiB}, demand="cell", waiting_since=2.0,
                        deferred_at=999.0),
    }
    round_ = parker_with(records, sample, {"A": "busy", "C": "busy", "D": "busy"}).round()
    assert [(d.kernel_id, d.need, d.since) for d in round_.demands] == [("A", {0: 20 * GiB}, 5.0)]
    assert [(r.kernel_id, r.held) for r in round_.reservations] == [("C", {0: 8 * GiB})]  # D waits for a newer reading


def test_the_last_check_before_a_restore_reads_the_device_now():
    totals = {0: 140 * GiB}
    assert room_right_now({0: 56 * GiB}, totals, lambda i: 80 * GiB, {}, GiB) is None
    short = room_right_now({0: 56 * GiB}, totals, lambda i: 84 * GiB, {}, GiB)
    assert short and "GPU 0 has 56.0 GiB free right now" in short and "waits for room again" in short
    # Another restore granted and not run yet takes its bytes first.
    assert room_right_now({0: 56 * GiB}, totals, lambda i: 40 * GiB, {0: 50 * GiB}, GiB) is not None
    assert "cannot be read" in room_right_now({0: GiB}, totals, lambda i: None, {}, GiB)


def test_on_a_hub_host_room_on_a_full_device_is_refused_plainly(monkeypatch):
    import asyncio

    from gpu_quota_ext.parking import HostBroker

    sample = Sample(state="ok", time=1.0, devices={0: DeviceReading(0, GiB)}, kernels={"A": {0: GiB}}, pids={})
    parker = parker_with({}, sample, {"A": "busy"})
    parker.settings = ParkSettings(on_device_full="on")
    parker.broker = HostBroker(SimpleNamespace(room=lambda body: {}), {0: "GPU-0"})
    accepted, park, why = asyncio.run(parker.request_room("A"))
    assert not accepted and "host service's broker makes room for resumes only" in why
    assert "A" not in parker.records  # nothing asked, nothing kept


def test_on_a_hub_host_a_wait_past_the_limit_is_told_even_when_the_service_does_not_tell_it():
    # The limit is this server's promise to its user ("at park_wait_limit the cell ends, not a hang"). A service that
    # does not answer (down, or an older one without the room route: 404), or whose own clock for the demand began
    # later (it answered "go" and the restore was deferred: named again, it is a new demand there), must not turn
    # the wait into a hang.
    import asyncio

    from gpu_quota_ext.parking import BrokerSettings, Demand, DeviceView, HostBroker, HostView, KernelView, Round

    def round_at(now):
        return Round(
            devices=(DeviceView(0, "GPU 0", 140 * GiB, 100 * GiB),),
            kernels=(KernelView("A", "waiting", {}, {0: 40 * GiB}, None, False, "kernel A"),),
            demands=(Demand("A", {0: 20 * GiB}, 1000.0),),
            reservations=(),
            host=HostView(),
            settings=BrokerSettings(wait_limit=300.0),
            now=now,
        )

    def unreachable(body):
        raise OSError("HTTP 404: Not Found")

    down = HostBroker(SimpleNamespace(room=unreachable), {0: "GPU-0"})
    early = asyncio.run(down.decide(round_at(1200.0)))
    assert "A" in early.waiting and not early.told
    late = asyncio.run(down.decide(round_at(1300.0)))
    assert "park_wait_limit" in late.told["A"] and "does not answer" in late.told["A"]

    silent = {"go": [], "park": [], "waiting": {"A": "needs 20.0 GiB on GPU-0; making room"}, "told": {}}
    quiet = HostBroker(SimpleNamespace(room=lambda body: silent), {0: "GPU-0"})
    plan = asyncio.run(quiet.decide(round_at(1300.0)))
    assert plan.told["A"].endswith("needs 20.0 GiB on GPU-0; making room")
    granted = HostBroker(SimpleNamespace(room=lambda body: {**silent, "go": ["A"]}), {0: "GPU-0"})
    assert not asyncio.run(granted.decide(round_at(1300.0))).told  # a go is a go, whenever it comes


def test_a_park_the_host_asks_for_is_made_only_of_a_kernel_still_idle_long_enough_here():
    # The host decided on a report up to a lease period old (idle 600 s then); the kernel ran a cell since and has
    # been idle a moment: parking it now would park a kernel its user is working in (park_min_idle). Still idle since
    # the report, it parks.
    import asyncio

    sample = Sample(
        state="ok", time=1000.0, devices={0: DeviceReading(0, 56 * GiB)}, kernels={"B": {0: 56 * GiB}},
        pids={"B": (os.getpid(),)},
    )
    parker = parker_with({}, sample, {"B": "idle"})
    parker.publish_host_report()  # the event loop's, after a sample: B idle for 600 s
    parker.host_report()  # the lease's report, as published
    parker.kernels.activity = lambda kernel_id: ("idle", datetime.datetime.now(datetime.timezone.utc))

    async def asked():
        parker.park_for_host(["B"])

    asyncio.run(asked())
    assert "B" not in parker.records  # not parked, nothing asked of the driver
    parker.kernels.activity = lambda kernel_id: ("idle", NOW - datetime.timedelta(seconds=600))

    async def asked_again():
        parker.park_for_host(["B"])
        state = parker.records["B"].state
        await parker.stop()
        return state

    assert asyncio.run(asked_again()) == "parking"


def test_a_park_of_this_servers_kernel_the_host_answers_a_room_call_with_says_why_in_whole_words():
    import asyncio

    from gpu_quota_ext.parking.host_broker import plan_from

    sample = Sample(
        state="ok", time=1000.0, devices={0: DeviceReading(0, 56 * GiB)}, kernels={"B": {0: 56 * GiB}},
        pids={"B": (os.getpid(),)},
    )
    parker = parker_with({}, sample, {"B": "idle"})

    async def applied():
        parker.apply(plan_from({"park": ["B"]}, ["B"], {0: "GPU-0"}))
        reason = parker.records["B"].reason
        await parker.stop()
        return reason

    assert asyncio.run(applied()) == "to make room for another kernel of this host"


def test_a_park_asked_right_after_a_cell_is_decided_on_a_sample_whose_reading_began_after_it():
    # The sample out when the park is asked was read before the cell's tensor existed: it says the kernel holds
    # nothing. The park must wait for the next one (issue 21: "a park requested right after a cell decides on a
    # fresh sample").
    import asyncio
    import time

    empty = Sample(state="ok", time=0.0, devices={0: DeviceReading(0, 0)}, kernels={}, pids={})
    parker = parker_with({}, empty, {"B": "idle"})
    parker.settings = ParkSettings(fresh_sample_wait=5.0)
    loop_samples = []

    def sample_soon():
        loop = asyncio.get_running_loop()
        if not loop_samples:  # the sample already out: its reading began before the request
            taken = time.time() - 0.05
            loop_samples.append(Sample(state="ok", time=taken, devices={0: DeviceReading(0, 0)}, kernels={}, pids={}))
        else:
            loop_samples.append(Sample(
                state="ok", time=time.time(), devices={0: DeviceReading(0, 20 * GiB)}, kernels={"B": {0: 20 * GiB}},
                pids={"B": (os.getpid(),)},
            ))
        sample = loop_samples[-1]

        def arrive():
            parker.monitor.latest = sample
            parker.on_sample(sample)

        loop.call_later(0.01, arrive)

    parker.monitor.sample_soon = sample_soon

    async def asked():
        accepted, park = await parker.request_park("B")
        await parker.stop()
        return accepted, park

    accepted, park = asyncio.run(asked())
    assert accepted, park


def test_on_a_hub_host_a_wait_that_ends_unserved_is_ended_at_the_service_at_once():
    # Alice interrupts her waiting cell (or it is told and ends): her server has no demand now. Unless it says so,
    # the service keeps deciding for that demand until her lease's next report (up to 15 s), and may ask another
    # user's server to park an idle kernel for a cell that no longer waits.
    import asyncio

    from gpu_quota_ext.parking import BrokerSettings, Demand, DeviceView, HostBroker, HostView, Round

    calls = []
    broker = HostBroker(SimpleNamespace(room=lambda body: calls.append(body) or {}), {0: "GPU-0"})

    def round_with(*demands):
        return Round((DeviceView(0, "GPU 0", 140 * GiB, 0),), (), demands, (), HostView(), BrokerSettings(), 10.0)

    asyncio.run(broker.decide(round_with(Demand("A", {0: GiB}, 1.0))))
    asyncio.run(broker.decide(round_with()))
    asyncio.run(broker.decide(round_with()))
    assert [body["demands"] for body in calls] == [[{"kernel_id": "A", "need": {"GPU-0": GiB}}], []]


def test_a_park_whose_driver_call_has_not_returned_is_not_counted_as_memory_coming():
    # Its checkpoint call is stuck (park_call_timeout passed): the broker must not wait for its bytes, which may never
    # leave, rather than park another idle kernel for a waiting cell.
    sample = Sample(
        state="ok", time=1000.0, devices={0: DeviceReading(0, 56 * GiB)}, kernels={"B": {0: 56 * GiB}}, pids={}
    )
    stuck = ParkRecord(state="parking", since=1.0, op=1, pids=(7,), parked={0: 56 * GiB}, stuck="has not returned")
    (b,) = parker_with({"B": stuck}, sample, {"B": "idle"}).round().kernels
    assert b.state != "parking" and not b.parkable


def test_under_a_host_service_that_does_not_broker_nothing_parks():
    # An older service: a parked kernel would wait for room nobody could give it.
    from gpu_quota_ext.parking import HostBroker

    sample = Sample(state="ok", time=1.0, devices={0: DeviceReading(0, GiB)}, kernels={"A": {0: GiB}}, pids={"A": (7,)})
    parker = parker_with({}, sample, {"A": "idle"})
    rooms = SimpleNamespace(room=lambda body: {}, brokers=True)
    parker.broker = HostBroker(rooms, {0: "GPU-0"})
    assert parker.problem("A") is None
    rooms.brokers = False
    assert "older version that does not broker device memory" in parker.problem("A")


def test_a_control_channel_that_fails_to_start_is_stopped_not_left_open():
    import asyncio

    from gpu_quota_ext.parking import KernelChannel

    stopped = []

    class Client:
        def start_channels(self, **channels):
            raise OSError("no such port")

        def stop_channels(self):
            stopped.append(True)

    channel = KernelChannel(SimpleNamespace(client=lambda kernel_id: Client()))
    assert asyncio.run(channel.ask("k", {"action": "trim"}, 1.0)) is None
    assert stopped == [True]
