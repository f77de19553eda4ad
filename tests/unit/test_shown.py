"""The state a kernel is shown in to the broker (parking/shown.py): one rule for a server's parker and for the host
service, checked here on the facts alone, then through both callers."""

import time

from gpu_quota_ext.devices import Device
from gpu_quota_ext.hub.service.book import Owned
from gpu_quota_ext.hub.service.room import Heard, HostRoom, ParkReport, host_round
from gpu_quota_ext.ledger import Grant
from gpu_quota_ext.parking import PARK_MARGIN, BrokerSettings, HostView, Said, park_time, shown_as
from gpu_quota_ext.parking.states import ParkRecord
from gpu_quota_ext.shared.park_state import ParkState
from gpu_quota_ext.shared.sizes import GiB
from gpu_quota_ext.usage import Sample
from gpu_quota_ext.usage.sampling import DeviceReading

from .test_parker_round import parker_with

NOW = 10_000.0


def test_a_kernel_never_heard_of_is_busy_and_never_parked():
    view = shown_as(Said(None, NOW), NOW)
    assert (view.state, view.idle_for, view.parkable) == (ParkState.BUSY, None, False)


def test_idle_time_is_what_was_said_plus_how_long_ago_and_only_of_an_idle_kernel():
    said = Said("idle", NOW - 30, idle_for=100.0, parkable=True)
    assert shown_as(said, NOW) == shown_as(said, NOW)  # pure
    view = shown_as(said, NOW)
    assert (view.state, view.idle_for, view.parkable) == (ParkState.IDLE, 130.0, True)
    for state in ("busy", "pending", "parked", "waiting", "resuming", "lost"):
        view = shown_as(Said(state, NOW, idle_for=100.0, parkable=True), NOW)
        assert view.state == state and view.idle_for is None and view.parkable is False


def test_parked_while_the_reading_still_counts_its_bytes_is_a_park_under_way():
    assert shown_as(Said("parked", NOW, in_reading=True), NOW).state == ParkState.PARKING
    assert shown_as(Said("parked", NOW, in_reading=False), NOW).state == ParkState.PARKED


def test_a_park_is_believed_no_longer_than_its_bytes_can_take_nor_once_its_call_is_stuck():
    nbytes = 5 * GiB
    began = NOW - park_time(nbytes)
    assert park_time(nbytes) == PARK_MARGIN + nbytes / 0.5e9
    assert shown_as(Said("parking", NOW, park_since=began, park_bytes=nbytes), NOW).state == ParkState.PARKING
    late = shown_as(Said("parking", NOW, park_since=began - 1, park_bytes=nbytes), NOW)
    assert late.state == ParkState.BUSY and not late.parkable
    # Said parked while the sample shows the bytes: the same park, timed the same way.
    assert shown_as(Said("parked", NOW, park_since=began - 1, park_bytes=nbytes, in_reading=True), NOW).state == "busy"
    assert shown_as(Said("parking", NOW, park_since=NOW, park_bytes=nbytes, stuck=True), NOW).state == "busy"
    # Not timed: the parker's own park done (only its reading is older than its end).
    assert shown_as(Said("parked", NOW, in_reading=True), NOW + 1e6).state == ParkState.PARKING


# --- the host service: what changed on its side --------------------------------------------------------------

UUID = "GPU-shown-0"
DEVICES = {0: Device(0, "Test GPU", UUID, 12 * GiB)}


def owned(kernel_id: str, user: str) -> Owned:
    cap = 5 * GiB
    return Owned(Grant(kernel_id, user, "python3", (0,), {0: cap}, {0: cap}, {0: cap}, "default", True), "", 0.0)


def host_view(heard: Heard, used: int, sampled_at: float):
    round_ = host_round(
        DEVICES, [owned("kb", "bob")], {UUID: used}, {"kb": {UUID: used}}, {"kb": heard}, [], [],
        HostView(available=64 * GiB), BrokerSettings(), "alice", NOW, sampled_at,
    )
    return round_.kernels[0]


def test_the_host_service_counts_a_parked_kernels_leftover_on_the_device_as_parked_not_as_a_park():
    # Bob's server said "parked" at NOW - 100 (first said so then). A sample taken after that still shows 0.6 GiB
    # of his kernel (what the fast park path leaves on the device): parked, not a park under way, and after the
    # park's time not "busy" either (which would claim his whole cap's headroom).
    room = HostRoom()
    room.hear("bob", "", {"kb": ParkReport("parking")}, NOW - 300, lease=True)
    room.hear("bob", "", {"kb": ParkReport("parked")}, NOW - 100, lease=True)
    room.hear("bob", "", {"kb": ParkReport("parked")}, NOW - 1, lease=True)  # renewals keep the first time
    heard = room.view()[0]["kb"]
    assert heard.parked_at == NOW - 100
    leftover = int(0.6 * GiB)
    assert host_view(heard, leftover, sampled_at=NOW - 50).state == ParkState.PARKED
    # A sample taken before that report still counts the park's bytes: its park is under way, then not believed.
    assert host_view(heard, 5 * GiB, sampled_at=NOW - 200).state == ParkState.BUSY  # 300 s > 60 s + 5 GiB's time
    assert host_view(heard, 5 * GiB, sampled_at=None).state == ParkState.BUSY  # the sample's time unknown: as before


def test_a_park_under_way_is_timed_only_where_its_driver_call_cannot_be_seen():
    # The host service times another server's park (park_time); the parker sees its own call: parking until the call
    # returns, or busy once park_call_timeout has marked it stuck. Timed there too, its server would report "busy"
    # while the call is out, and the host service end the park's host promise while its bytes still come.
    now = time.time()
    over = park_time(5 * GiB) + 1
    reading = {0: DeviceReading(0, 5 * GiB)}
    sample = Sample(state="ok", time=now - 1, devices=reading, kernels={"B": {0: 5 * GiB}}, pids={})
    for stuck, expected in ((None, ParkState.PARKING), ("has not returned", ParkState.BUSY)):
        record = ParkRecord(state="parking", since=now - over, op=1, pids=(7,), parked={0: 5 * GiB}, stuck=stuck)
        (kernel,) = parker_with({"B": record}, sample, {"B": "idle"}).round().kernels
        assert kernel.state == expected
    heard = Heard(ParkReport("parking"), "bob", "", NOW - 1, since=NOW - over)
    assert host_view(heard, 5 * GiB, sampled_at=NOW - 1).state == ParkState.BUSY
