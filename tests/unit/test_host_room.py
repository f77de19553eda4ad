"""The host's broker as the service keeps it (hub/service/room.py): pure, fed by hand. One GPU of 12 GiB, three
users each with a kernel of 5 GiB; the broker's own rules are tested in test_broker.py: here, what the service
believes of whom, what it keeps between decisions, and what each user's server is told."""

from __future__ import annotations

import pytest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.hub.service.book import Owned
from gpu_quota_ext.hub.service.room import (
    DECLINE_GRACE,
    OTHERS,
    RESERVATION_MARGIN,
    HostRoom,
    ParkReport,
    RoomRefused,
    check_request,
    host_round,
    own_reports,
    reservation_timeout,
)
from gpu_quota_ext.ledger import Grant
from gpu_quota_ext.parking import PARK_MARGIN, PARK_RATE, BrokerSettings, HostReading, HostView, decide
from gpu_quota_ext.shared.service_contract import CONTEXT_ALLOWANCE, SWAP_WAIT
from gpu_quota_ext.shared.sizes import GiB

UUID = "GPU-room-0"
DEVICES = {0: Device(0, "Test GPU", UUID, 12 * GiB)}
CAP = int(5.4 * GiB)
SETTINGS = BrokerSettings(device_margin=GiB, host_margin=2 * GiB, min_idle=2.0, wait_limit=300.0)
HOST = HostView(available=64 * GiB)


def owned(kernel_id: str, user: str, server: str = "", cap: int = CAP) -> Owned:
    grant = Grant(kernel_id, user, "python3", (0,), {0: cap}, {0: cap}, {0: cap}, "default", True)
    return Owned(grant, server, 0.0)


HELD = [owned("ka-alice", "alice"), owned("kb-bob", "bob"), owned("kc-carol", "carol")]
IDLE = lambda seconds: ParkReport("idle", seconds, True)  # noqa: E731


class Host:
    """The service's part around the room, by hand: its sample, its reports, one room call at a time."""

    def __init__(self, used=None):
        self.room = HostRoom()
        self.kernel_used = dict({"kb-bob": {UUID: 5 * GiB}, "kc-carol": {UUID: 5 * GiB}} if used is None else used)
        self.now = 1000.0
        self.sampled_at = 999.9  # the last sample: a moment ago

    @property
    def device_used(self):
        return {UUID: sum(per.get(UUID, 0) for per in self.kernel_used.values())}

    def lease(self, user, reports, server=""):
        self.room.hear(user, server, own_reports(HELD, user, server, reports), self.now, lease=True)

    def call(self, user, reports, demands, server="", owned_=HELD, may_wait=frozenset()):
        checked = check_request(owned_, DEVICES, user, server, reports, demands, self.room.seen())
        self.room.hear(user, server, checked.reports, self.now, lease=False)
        self.room.ask(user, server, checked.demands, self.now, may_wait)
        heard, waiting, held, taken = self.room.view()
        round_ = host_round(
            DEVICES, owned_, self.device_used, self.kernel_used, heard, waiting, held, HOST, SETTINGS, user, self.now,
            self.sampled_at, taken,
        )
        return self.room.answer(decide(round_), user, server, owned_, self.now)


def parked_others() -> Host:
    """Bob's and carol's kernels are parked: the device is empty."""
    host = Host({})
    host.lease("bob", {"kb-bob": ParkReport("parked")})
    host.lease("carol", {"kc-carol": ParkReport("parked")})
    return host


def alice_waits(host: Host):
    """Alice's kernel is parked (its 5 GiB on the host) and her cell asks for it back."""
    return host.call("alice", {"ka-alice": ParkReport("waiting")}, {"ka-alice": {UUID: 5 * GiB}})


def test_a_resume_parks_another_users_least_recently_active_idle_kernel_through_its_lease():
    host = Host()
    host.lease("bob", {"kb-bob": IDLE(100.0)})
    host.lease("carol", {"kc-carol": IDLE(50.0)})
    answer = alice_waits(host)
    # Room: 12 - 10 used - 0.8 headroom - 1 margin < 5: one park is enough, bob's (idle the longest).
    assert answer.go == () and answer.park == ()  # nothing of alice's server parks
    assert answer.wake == (("bob", ""),)
    assert "making room: idle kernel of another user parks now" in answer.waiting["ka-alice"]
    assert "bob" not in str(answer.json()) and "kb-bob" not in str(answer.json())
    assert host.room.pending("bob", "") and not host.room.pending("carol", "")
    assert host.room.take("bob", "", HELD, host.now) == ["kb-bob"]
    assert host.room.take("bob", "", HELD, host.now) == []  # taken once
    # Asked again at alice's next sample, before bob's server has said anything since: not asked twice.
    host.now += 0.5
    assert alice_waits(host).wake == ()
    # Bob's server parks it: the sample shows its memory gone, its report says parked. Alice's next call: go.
    host.now += 0.5
    host.lease("bob", {"kb-bob": ParkReport("parked")})
    host.kernel_used["kb-bob"] = {}
    answer = alice_waits(host)
    assert answer.go == ("ka-alice",) and answer.waiting == {}
    status = host.room.status(HELD, "alice", False, host.now)
    assert status["reservations"][0]["held"] == {UUID: 5 * GiB} and status["waiting"] == []


def test_a_park_reported_before_the_sample_shows_it_is_waited_for_not_added_to():
    host = Host()
    host.lease("bob", {"kb-bob": IDLE(100.0)})
    host.lease("carol", {"kc-carol": IDLE(50.0)})
    alice_waits(host)
    host.room.take("bob", "", HELD, host.now)
    host.now += 1
    # Bob's server says parked; the service's last sample was taken before (it still shows bob's 5 GiB).
    host.lease("bob", {"kb-bob": ParkReport("parked")})
    answer = alice_waits(host)
    assert answer.go == () and answer.wake == ()  # carol is not parked for the bytes already leaving
    assert "parking" in answer.waiting["ka-alice"]
    assert not host.room.pending("carol", "")


def test_a_kernel_taken_to_park_whose_memory_a_later_sample_shows_gone_counts_as_parked():
    host = Host()
    host.lease("bob", {"kb-bob": IDLE(100.0)})
    host.lease("carol", {"kc-carol": IDLE(50.0)})
    alice_waits(host)
    host.now += 0.2
    taken = host.now
    assert host.room.take("bob", "", HELD, taken) == ["kb-bob"]
    host.lease("bob", {"kb-bob": IDLE(100.2)})  # its renewal right after the answer: not parked yet
    host.now += 0.5
    assert alice_waits(host).go == ()  # the last sample is from before the request: bob's memory is there
    assert not host.room.pending("carol", "")  # bob's park is waited for, carol is not asked
    host.kernel_used["kb-bob"] = {}
    host.sampled_at = taken + 0.3  # a sample taken since: bob's memory has left the device
    assert alice_waits(host).go == ("ka-alice",)


def test_a_kernel_never_reported_is_running_and_never_parked():
    host = Host()
    host.lease("carol", {"kc-carol": IDLE(50.0)})  # bob's server never reported: his kernel counts as busy
    answer = alice_waits(host)
    assert answer.wake == (("carol", ""),)
    assert not host.room.pending("bob", "")


def test_a_kernel_idle_less_than_park_min_idle_is_not_parked_and_the_reason_says_why():
    host = Host()
    host.lease("bob", {"kb-bob": IDLE(1.0)})
    host.lease("carol", {"kc-carol": ParkReport("busy")})
    answer = alice_waits(host)
    assert answer.wake == () and "idle for 2 s or more" in answer.waiting["ka-alice"]
    host.now += 1.5  # the service ages the report: bob's kernel is now idle 2.5 s
    assert alice_waits(host).wake == (("bob", ""),)


def test_a_report_of_idle_but_not_parkable_is_never_a_victim():
    host = Host()
    host.lease("bob", {"kb-bob": ParkReport("idle", 500.0, False)})
    host.lease("carol", {"kc-carol": IDLE(50.0)})
    assert alice_waits(host).wake == (("carol", ""),)


def test_a_victim_of_the_callers_own_server_is_in_its_answer():
    both = [owned("ka-alice", "alice"), owned("ka2-alice", "alice"), owned("kb-bob", "bob")]
    host = Host({"ka2-alice": {UUID: 5 * GiB}, "kb-bob": {UUID: 5 * GiB}})
    host.lease("bob", {"kb-bob": IDLE(10.0)})
    reports = {"ka-alice": ParkReport("waiting"), "ka2-alice": IDLE(100.0)}
    answer = host.call("alice", reports, {"ka-alice": {UUID: 5 * GiB}}, owned_=both)
    assert answer.park == ("ka2-alice",) and answer.wake == ()
    assert "idle kernel ka2-alic parks now" in answer.waiting["ka-alice"]


def test_the_wait_is_the_services_own_and_ends_with_the_message_at_the_limit():
    host = Host()
    host.lease("bob", {"kb-bob": ParkReport("busy")})
    host.lease("carol", {"kc-carol": ParkReport("busy")})
    first = host.now
    assert alice_waits(host).told == {}
    host.now = first + 299
    assert alice_waits(host).told == {}
    host.now = first + 300
    told = alice_waits(host).told["ka-alice"]
    assert told.startswith("waited 300 s (the park_wait_limit) for device memory")
    (waiting,) = host.room.status(HELD, "alice", False, host.now)["waiting"]
    assert waiting["waited"] == 300 and waiting["told"] == told


def test_a_demand_its_server_no_longer_names_has_ended():
    host = Host()
    alice_waits(host)
    host.call("alice", {"ka-alice": ParkReport("parked")}, {})
    assert host.room.status(HELD, "alice", False, host.now)["waiting"] == []
    alice_waits(host)
    host.lease("alice", {"ka-alice": ParkReport("parked")})  # a lease saying it no longer waits ends it too
    assert host.room.view()[1] == []


def test_a_reservation_holds_until_the_sample_shows_the_memory_back_and_blocks_others_meanwhile():
    host = parked_others()
    answer = alice_waits(host)
    assert answer.go == ("ka-alice",)
    # Bob's parked kernel asks for 5 GiB too: 12 - 5 reserved - 1 margin leaves 6: fits; a third would not.
    assert host.call("bob", {"kb-bob": ParkReport("waiting")}, {"kb-bob": {UUID: 5 * GiB}}).go == ("kb-bob",)
    carol = host.call("carol", {"kc-carol": ParkReport("waiting")}, {"kc-carol": {UUID: 5 * GiB}})
    assert carol.go == () and "kc-carol" in carol.waiting
    # A sample taken before alice's go does not end her reservation; one after it, showing her usage, does.
    host.room.note_sample(host.now - 1, {"ka-alice": {UUID: 5 * GiB}})
    assert {h.kernel_id for h in host.room.view()[2]} == {"ka-alice", "kb-bob"}
    host.room.note_sample(host.now + 1, {"ka-alice": {UUID: 5 * GiB}})
    assert {h.kernel_id for h in host.room.view()[2]} == {"kb-bob"}


def test_a_reservation_ends_on_a_sample_after_a_report_of_the_kernel_running_or_at_its_timeout():
    host = parked_others()
    alice_waits(host)
    assert reservation_timeout({UUID: 5 * GiB}) == pytest.approx(5 * GiB / 2e9 + RESERVATION_MARGIN)
    host.now += 1
    host.lease("alice", {"ka-alice": ParkReport("idle", 0.0, True)})  # it ran and freed its memory at once
    host.room.note_sample(host.now - 0.5, {})
    assert host.room.view()[2]
    host.room.note_sample(host.now + 0.5, {})
    assert host.room.view()[2] == []
    alice_waits(host)
    (held,) = host.room.view()[2]
    host.room.expire(held.until - 0.1, {"ka-alice"}, 60)
    assert host.room.view()[2]
    host.room.expire(held.until, {"ka-alice"}, 60)
    assert host.room.view()[2] == []


def test_asked_again_while_its_room_is_held_it_goes_again_on_the_same_reservation():
    host = parked_others()
    alice_waits(host)
    (held,) = host.room.view()[2]
    host.now += 2
    host.kernel_used["kb-bob"] = {UUID: 6 * GiB}  # memory taken since (a process outside the quota)
    assert alice_waits(host).go == ("ka-alice",)
    assert host.room.view()[2] == [held]  # the same room, its time not renewed


def test_the_room_call_is_checked_whole_and_nothing_is_kept_on_a_refusal():
    host = Host()
    before = host.room.view()
    with pytest.raises(RoomRefused) as refused:
        host.call("alice", {"ka-alice": ParkReport("waiting")}, {"kb-bob": {UUID: GiB}})
    assert (refused.value.code, refused.value.message) == (403, "kernel kb-bob is another user's")
    with pytest.raises(RoomRefused) as refused:
        host.call("alice", {"kb-bob": IDLE(500.0)}, {})  # a report of another user's kernel
    assert refused.value.code == 403
    with pytest.raises(RoomRefused) as refused:
        host.call("alice", {}, {"ka-alice": {UUID: GiB}}, server="other")
    assert refused.value.code == 403 and "held by your server '(default)', not by 'other'" in refused.value.message
    with pytest.raises(RoomRefused) as refused:
        host.call("alice", {}, {"ka-alice": {UUID: GiB, "GPU-nowhere": GiB, "GPU-else": 1}})
    assert refused.value.code == 400
    assert refused.value.message == f"device GPU-else, GPU-nowhere is not one of this host's GPUs ({UUID})"
    assert host.room.view() == before


def test_a_need_is_cut_to_the_cap_plus_the_context_allowance_and_an_unknown_kernel_is_answered():
    checked = check_request(HELD, DEVICES, "alice", "", {}, {"ka-alice": {UUID: 100 * GiB}, "gone": {UUID: GiB}})
    assert checked.demands == {"ka-alice": {UUID: CAP + CONTEXT_ALLOWANCE}}
    assert checked.unknown == ("gone",)


def test_a_lease_reports_only_its_users_own_kernels_on_that_server():
    reports = {"ka-alice": IDLE(9.0), "kb-bob": IDLE(999.0), "nobody": IDLE(1.0)}
    assert own_reports(HELD, "alice", "", reports) == {"ka-alice": IDLE(9.0)}
    assert own_reports(HELD, "alice", "other", reports) == {}


def test_status_shows_each_user_their_own_and_the_admin_all():
    host = Host()
    host.lease("bob", {"kb-bob": IDLE(100.0)})
    host.lease("carol", {"kc-carol": IDLE(50.0)})
    alice_waits(host)
    admin = host.room.status(HELD, "root", True, host.now + 2)
    assert admin["park"]["kb-bob"] == {
        "state": "idle", "idle_for": 102.0, "parkable": True, "reported": 2.0, "declined_park": None
    }
    assert [w["kernel_id"] for w in admin["waiting"]] == ["ka-alice"]
    (request,) = admin["park_requests"]
    assert (request["kernel_id"], request["for_kernel"], request["taken"]) == ("kb-bob", "ka-alice", False)
    bobs = host.room.status([o for o in HELD if o.grant.user == "bob"], "bob", False, host.now)
    assert bobs["waiting"] == [] and bobs["park_requests"][0]["for_kernel"] is None
    assert set(bobs["park"]) == {"kb-bob"}


def test_a_grant_gone_takes_everything_of_its_kernel_with_it():
    host = Host()
    host.lease("bob", {"kb-bob": IDLE(100.0)})
    alice_waits(host)
    host.room.expire(host.now, {"kc-carol"}, 60)
    heard, waiting, held, taken = host.room.view()
    assert heard == {} and waiting == [] and held == [] and taken == {}
    assert not host.room.pending("bob", "")


def test_words_name_another_users_kernel_without_its_id():
    assert OTHERS == "of another user"


def test_a_demand_of_a_kernel_the_sample_shows_on_the_device_parks_nobody():
    # Bob's server names his running kernel (5 GiB on the device, as the service's own sample shows) as waiting for
    # 5.4 GiB: a resume only comes from a parked kernel, which the sample shows holding nothing there. Believed, it
    # would make the service park carol's idle kernel (and reserve room) for a kernel that is not parked.
    host = Host({"ka-alice": {UUID: 5 * GiB}, "kb-bob": {UUID: 5 * GiB}, "kc-carol": {UUID: GiB}})
    host.lease("alice", {"ka-alice": IDLE(100.0)})
    host.lease("carol", {"kc-carol": IDLE(100.0)})
    answer = host.call("bob", {"kb-bob": ParkReport("waiting")}, {"kb-bob": {UUID: CAP}})
    assert answer.go == () and answer.wake == () and not host.room.pending("alice", "")
    # Once a sample taken after its park shows it off the device, its demand is decided as any other.
    host.kernel_used["kb-bob"] = {}
    host.now += 1
    assert host.call("bob", {"kb-bob": ParkReport("waiting")}, {"kb-bob": {UUID: CAP}}).wake == (("alice", ""),)


def test_a_fast_parked_kernel_whose_context_stays_on_the_device_is_decided_but_not_one_that_holds_more():
    # Bob's kernel was parked by the fast path: its CUDA context (612 MiB) stays on the device, and his server says
    # so ("stays"). His resume is decided like any parked kernel's (without the word it would wait for bytes that
    # never leave). A server whose kernel holds more than it says stays is not believed: it waits, parks nobody.
    context = 612 * 2**20
    host = Host({"ka-alice": {UUID: 5 * GiB}, "kb-bob": {UUID: context}, "kc-carol": {UUID: GiB}})
    host.lease("alice", {"ka-alice": IDLE(100.0)})
    host.lease("carol", {"kc-carol": IDLE(100.0)})
    waiting = ParkReport("waiting", stays=context)
    assert host.call("bob", {"kb-bob": waiting}, {"kb-bob": {UUID: CAP}}).wake == (("alice", ""),)
    host = Host({"ka-alice": {UUID: 5 * GiB}, "kb-bob": {UUID: context + GiB}, "kc-carol": {UUID: GiB}})
    host.lease("alice", {"ka-alice": IDLE(100.0)})
    host.lease("carol", {"kc-carol": IDLE(100.0)})
    answer = host.call("bob", {"kb-bob": waiting}, {"kb-bob": {UUID: CAP}})
    assert answer.go == () and answer.wake == () and not host.room.pending("alice", "")


def test_a_report_of_parking_that_never_ends_does_not_hold_up_another_users_resume_for_good():
    # Bob's server reports his running kernel (5 GiB on the device) as parking, or parked, at every renewal. The
    # broker counts those bytes as coming and waits for them rather than park carol's idle kernel: believed for
    # good, alice's resume would be held up to her wait limit, and past it, for as long as bob's server says so.
    host = Host()
    host.lease("carol", {"kc-carol": IDLE(100.0)})
    waited = []
    for step in range(10):
        host.lease("bob", {"kb-bob": ParkReport("parking" if step % 2 else "parked")})
        answer = alice_waits(host)
        if answer.wake:
            break
        waited.append(step)
        host.now += 10
    assert answer.wake == (("carol", ""),)
    assert 60 <= 10 * len(waited) <= 80  # a park of 5 GiB is believed for 60 s plus 5 GiB at 0.5 GB/s


def test_a_need_beyond_the_cap_is_reserved_whole_when_the_service_saw_the_kernel_hold_it():
    # Alice's kernel held 9 GiB (torch up to its 5.4 GiB cap, a CuPy pool and its context beside it) before it
    # parked. Cut to cap + CONTEXT_ALLOWANCE (7.4 GiB), the reservation would be short of what its restore takes, and
    # another server's restore granted beside it, its own fresh check passing at the same moment, could leave the
    # device too full for one of them: a failed restore, the kernel lost.
    host = Host({"ka-alice": {UUID: 9 * GiB}})
    host.room.note_sample(host.now - 5, host.kernel_used)
    host.kernel_used = {}  # parked: the service's samples show it off the device
    answer = host.call("alice", {"ka-alice": ParkReport("waiting")}, {"ka-alice": {UUID: 9 * GiB}})
    assert answer.go == ("ka-alice",)
    (held,) = host.room.view()[2]
    assert held.held == {UUID: 9 * GiB}
    # Bob's parked kernel (3.5 GiB) does not fit beside it: 12 - 9 - 1 < 3.5.
    bob = host.call("bob", {"kb-bob": ParkReport("waiting")}, {"kb-bob": {UUID: int(3.5 * GiB)}})
    assert bob.go == ()
    # A claim beyond what the service ever saw the kernel hold is still cut.
    checked = check_request(HELD, DEVICES, "carol", "", {}, {"kc-carol": {UUID: 100 * GiB}}, host.room.seen())
    assert checked.demands == {"kc-carol": {UUID: CAP + CONTEXT_ALLOWANCE}}


def test_a_server_that_takes_a_park_request_and_never_parks_stalls_nobody():
    # Issue 30, item 2: bob's server reports his kernel idle for 100,000 s and parkable, takes the park request,
    # and goes on reporting it idle and parkable. Once its report DECLINE_GRACE after taking it still says so, the
    # broker chooses carol's honest idle kernel at once, and does not ask bob's again before his server reports
    # a change.
    host = Host()
    host.lease("bob", {"kb-bob": IDLE(100_000.0)})
    host.lease("carol", {"kc-carol": IDLE(50.0)})
    assert alice_waits(host).wake == (("bob", ""),)
    assert host.room.take("bob", "", HELD, host.now) == ["kb-bob"]
    host.now += 1
    host.lease("bob", {"kb-bob": IDLE(100_001.0)})  # too soon to say: a server acts on its lease's answer
    assert alice_waits(host).wake == ()
    host.now += DECLINE_GRACE
    host.lease("bob", {"kb-bob": IDLE(100_006.0)})
    assert alice_waits(host).wake == (("carol", ""),)
    admin = host.room.status(HELD, "admin", True, host.now)
    assert admin["park"]["kb-bob"]["declined_park"] == 0.0 and admin["park"]["kc-carol"]["declined_park"] is None
    # Bob's kernel runs a cell, then idles again: a change, so it may be chosen again.
    host.lease("bob", {"kb-bob": ParkReport("busy")})
    host.lease("bob", {"kb-bob": IDLE(1.0)})
    assert host.room.status(HELD, "admin", True, host.now)["park"]["kb-bob"]["declined_park"] is None


def test_the_limit_on_believing_a_park_counts_from_its_first_report_whatever_blips_come_between():
    # Issue 30, item 3: bob's server reports "parking" for good, with a "busy" report every 40 s. Counted from each
    # new "parking", the limit (60 s + 5 GiB at 0.5 GB/s) would never pass and carol would never be asked.
    host = Host()
    host.lease("carol", {"kc-carol": IDLE(100.0)})
    waited = 0
    for step in range(20):
        state = "busy" if step % 4 == 3 else "parking"
        host.lease("bob", {"kb-bob": ParkReport(state)})
        host.lease("bob", {"kb-bob": ParkReport("parking")})
        answer = alice_waits(host)
        if answer.wake:
            break
        waited += 10
        host.now += 10
    assert answer.wake == (("carol", ""),)
    assert 60 <= waited <= 80
    # A sample showing bob's kernel off the device ends that park's claim: his next park is believed afresh.
    host.kernel_used["kb-bob"] = {}
    host.room.note_sample(host.now + 1, host.kernel_used)
    assert "kb-bob" not in host.room._claimed


def test_a_restart_of_the_service_keeps_the_room_of_a_restore_in_flight(tmp_path):
    # Issue 30, item 1: alice's resume got "go" (6 GiB reserved) and her restore is under way, the service's sample
    # showing none of it back yet; the service is killed and the hub restarts it. Kept only in memory, that room went
    # to carol's resume 0.3 s after the restart, and alice's restore then found too little: her GPU state lost.
    from gpu_quota_ext.hub.service.store import Store

    need = {UUID: 6 * GiB}  # two of them do not fit the 12 GiB device with its 1 GiB margin
    store = Store(str(tmp_path / "state"), list(DEVICES.values()))
    before = Host({})
    answer = before.call("alice", {"ka-alice": ParkReport("waiting")}, {"ka-alice": need})
    assert answer.go == ("ka-alice",)
    store.save_reservations(before.room.reservations())  # what app.room_call does before answering "go"
    store.close()

    def carol_after_restart(restored: bool):
        after = Host({})
        after.now = before.now + 19  # the hub restarted the service 19 s later
        if restored:
            after.room.restore(Store(str(tmp_path / "state"), list(DEVICES.values())).load_reservations())
        return after.call("carol", {"kc-carol": ParkReport("waiting")}, {"kc-carol": need})

    assert carol_after_restart(restored=False).go == ("kc-carol",)  # what happened before: the room given away
    answer = carol_after_restart(restored=True)
    assert answer.go == () and "kc-carol" in answer.waiting


def test_one_users_reservations_stay_within_that_users_budget_padding_included():
    # Issue 30, item 5: dave holds 12 kernels of 512 MiB (6 GiB, his whole budget), all parked; each demand is
    # padded up to cap + CONTEXT_ALLOWANCE. Unbounded, 10 GiB of the 12 GiB device were reserved for him with
    # nothing restored while alice waited. With the bound, his reservations and use stay within his 6 GiB.
    from gpu_quota_ext.hub.service.limits import reservation_over_budget
    from gpu_quota_ext.hub.service.user_policy import host_limits

    small = int(0.5 * GiB)
    daves = [owned(f"kd-dave-{i:02d}", "dave", cap=small) for i in range(12)]
    limits = host_limits(user_budget="6GiB")
    by_uuid = {d.uuid: d for d in DEVICES.values()}
    host = Host({})
    reserved, bounded = 0, set()
    for item in daves:
        kernel_id = item.grant.kernel_id
        reports, demands = {kernel_id: ParkReport("waiting")}, {kernel_id: {UUID: 3 * GiB}}
        checked = check_request(daves, DEVICES, "dave", "", reports, demands)
        host.room.hear("dave", "", checked.reports, host.now, lease=False)
        host.room.ask("dave", "", {**{w.kernel_id: w.need for w in host.room.view()[1]}, **checked.demands}, host.now)
        heard, waiting, held, taken = host.room.view()
        round_ = host_round(
            DEVICES, daves, host.device_used, {}, heard, waiting, held, HOST, SETTINGS, "dave", host.now, None, taken
        )
        bound = lambda claimed: reservation_over_budget({}, claimed, by_uuid, limits)  # noqa: E731
        answer = host.room.answer(decide(round_), "dave", "", daves, host.now, bound)
        reserved = sum(sum(h.held.values()) for h in host.room.reservations())
        assert reserved <= 6 * GiB
        bounded |= {k for k, why in answer.waiting.items() if "more than your 6.0 GiB (user_budget 6GiB)" in why}
        host.now += 1
    assert reserved > 0 and bounded  # some of his resumes were served, the rest held to his budget


def test_the_bound_counts_what_the_users_kernels_use_beside_what_they_reserve():
    from gpu_quota_ext.hub.service.limits import reservation_over_budget
    from gpu_quota_ext.hub.service.user_policy import host_limits

    by_uuid = {d.uuid: d for d in DEVICES.values()}
    limits = host_limits(user_budget="6GiB")
    assert reservation_over_budget({UUID: 2 * GiB}, {UUID: 4 * GiB}, by_uuid, limits) is None  # exactly 6 GiB
    assert reservation_over_budget({UUID: 2 * GiB + 1}, {UUID: 4 * GiB}, by_uuid, limits) is not None
    assert reservation_over_budget({}, {UUID: 100 * GiB}, by_uuid, host_limits(user_budget="none")) is None  # no bound
    assert reservation_over_budget({}, {"GPU-elsewhere": 100 * GiB}, by_uuid, limits) is None  # not this host's


# --- host memory: one account for every user's parks ------------------------------------------------------------


def test_two_users_parks_in_the_same_second_never_promise_more_than_the_host_has():
    room = HostRoom()
    room.note_sample(999.0, {"ka-alice": {UUID: 56 * GiB}, "kb-bob": {UUID: 56 * GiB}})
    host = HostReading(available=70 * GiB)  # one kernel parked already
    assert room.promise_host("ka-alice", 56 * GiB, host, 2 * GiB, 1000.0) is None
    refused = room.promise_host("kb-bob", 56 * GiB, host, 2 * GiB, 1000.2)
    assert refused is not None and "parks under way will still bring 56.0 GiB" in refused
    assert room.host_promised() == 56 * GiB


def test_a_server_that_understates_its_park_is_promised_what_the_service_saw():
    room = HostRoom()
    room.note_sample(999.0, {"ka-alice": {UUID: 40 * GiB}})
    assert room.promise_host("ka-alice", 1, HostReading(available=100 * GiB), 2 * GiB, 1000.0) is None
    assert room.host_promised() == 40 * GiB


def test_a_promise_ends_when_its_server_reports_the_park_done_or_its_time_is_past():
    room = HostRoom()
    room.note_sample(999.0, {"ka-alice": {UUID: 20 * GiB}, "kb-bob": {UUID: 20 * GiB}})
    host = HostReading(available=100 * GiB)
    room.promise_host("ka-alice", 20 * GiB, host, 2 * GiB, 1000.0)
    room.promise_host("kb-bob", 20 * GiB, host, 2 * GiB, 1000.0)
    room.hear("alice", "", {"ka-alice": ParkReport("parking", None, False)}, 1001.0, lease=True)
    assert room.host_promised() == 40 * GiB  # still copying
    room.hear("alice", "", {"ka-alice": ParkReport("parked", None, False)}, 1010.0, lease=True)
    assert room.host_promised() == 20 * GiB  # alice's bytes are in the host's reading now
    room.expire(1000.0 + 20 * GiB / PARK_RATE + PARK_MARGIN + 1, {"ka-alice", "kb-bob"}, 60.0)
    assert room.host_promised() == 0  # bob's server never said: not believed past a park's longest time


def test_another_servers_park_reported_under_way_without_a_promise_counts_whole():
    room = HostRoom()
    room.note_sample(999.0, {"ka-alice": {UUID: 50 * GiB}, "kb-bob": {UUID: 30 * GiB}})
    room.hear("alice", "", {"ka-alice": ParkReport("parking", None, False)}, 1000.0, lease=True)
    refused = room.promise_host("kb-bob", 30 * GiB, HostReading(available=80 * GiB), 2 * GiB, 1000.5)
    assert refused is not None and "the host has 30.0 GiB" in refused  # 80 less alice's 50 under way


def test_a_host_park_for_another_users_kernel_is_refused_and_changes_nothing():
    with pytest.raises(RoomRefused) as refusal:
        check_request(HELD, DEVICES, "bob", "", {"ka-alice": ParkReport("idle", None, False)}, {})
    assert refusal.value.code == 403


# --- a swap: a fast-path resume that goes while the park making its room still copies -----------------------------

CONTEXT = 612 * 2**20  # what a fast park leaves on the device: the kernel's CUDA context


def swap_host(alice_stays: int = CONTEXT) -> Host:
    """Alice's kernel was parked (by the fast path: its context stays on the device, where `alice_stays` > 0), bob's
    park is under way (the sample still shows his 5 GiB), carol's kernel is idle and not parkable: the device has
    no room for alice's 5 GiB until bob's bytes leave."""
    host = Host({"ka-alice": {UUID: alice_stays}, "kb-bob": {UUID: 5 * GiB}, "kc-carol": {UUID: 5 * GiB}})
    host.lease("carol", {"kc-carol": ParkReport("idle", 100.0, False)})
    return host


def alice_asks_to_swap(host: Host, stays: int = CONTEXT, may_wait=frozenset({"ka-alice"})):
    report = ParkReport("waiting", stays=stays)
    return host.call("alice", {"ka-alice": report}, {"ka-alice": {UUID: 5 * GiB}}, may_wait=may_wait)


def test_a_fast_resume_goes_while_another_users_park_that_releases_as_it_copies_is_under_way():
    host = swap_host()
    host.lease("bob", {"kb-bob": ParkReport("parking", releases_as_copied=True)})
    answer = alice_asks_to_swap(host)
    assert answer.go == ("ka-alice",) and answer.waiting == {} and answer.wake == ()
    # What of its need is not free yet: 5 GiB less the room there is now (12 - 10.6 used - 1 margin).
    short = 5 * GiB - (12 * GiB - (10 * GiB + CONTEXT) - GiB)
    assert answer.freeing == {"ka-alice": {UUID: short}}
    assert answer.json()["freeing"] == {"ka-alice": {UUID: short}} and "bob" not in str(answer.json())
    # Its room is reserved like any go's; asked again on it (its answer lost), it is "go" again with the same word
    # of what is being freed: its server cannot see bob's park.
    assert host.room.status(HELD, "alice", False, host.now)["reservations"][0]["held"] == {UUID: 5 * GiB}
    host.now += 0.5
    again = alice_asks_to_swap(host)
    assert again.go == ("ka-alice",) and again.freeing == {"ka-alice": {UUID: short}}


def test_without_the_park_releasing_as_it_copies_the_fast_resume_waits_for_the_park_to_end():
    host = swap_host()
    host.lease("bob", {"kb-bob": ParkReport("parking")})
    answer = alice_asks_to_swap(host)
    assert answer.go == () and answer.freeing == {} and "parking" in answer.waiting["ka-alice"]
    assert answer.json()["freeing"] == {}


def test_a_resume_said_to_wait_is_not_believed_of_a_kernel_its_server_did_not_report_fast_parked():
    # Checkpoint-parked (nothing of it on the device, no "stays"): its restore must never go into a device that is
    # not free yet (the driver would lose the process), whatever its server says.
    host = swap_host(alice_stays=0)
    host.lease("bob", {"kb-bob": ParkReport("parking", releases_as_copied=True)})
    answer = alice_asks_to_swap(host, stays=0)
    assert answer.go == () and answer.freeing == {} and "parking" in answer.waiting["ka-alice"]
    # Fast-parked but not said to wait: it waits too (the server's word "may_wait" is needed as well).
    host = swap_host()
    host.lease("bob", {"kb-bob": ParkReport("parking", releases_as_copied=True)})
    answer = alice_asks_to_swap(host, may_wait=frozenset())
    assert answer.go == () and answer.freeing == {}


@pytest.mark.parametrize(
    "bobs",
    [
        ParkReport("idle", 100.0, False, releases_as_copied=True),  # not a park at all
        ParkReport("busy", releases_as_copied=True),
        # Parked, and the sample, taken before, still shows its bytes: shown as a park under way, but the word is
        # only believed of a kernel reported "parking".
        ParkReport("parked", releases_as_copied=True),
    ],
)
def test_releases_as_copied_said_of_a_kernel_not_reported_parking_is_ignored(bobs):
    host = swap_host()
    host.lease("bob", {"kb-bob": bobs})
    answer = alice_asks_to_swap(host)
    assert answer.go == () and answer.freeing == {}


def test_releases_as_copied_is_believed_no_longer_than_the_park_is():
    host = swap_host()
    host.lease("bob", {"kb-bob": ParkReport("parking", releases_as_copied=True)})
    host.now += PARK_MARGIN + 5 * GiB / PARK_RATE + 1  # longer than a park of bob's 5 GiB can take: bob runs
    host.sampled_at = host.now - 0.1
    host.lease("bob", {"kb-bob": ParkReport("parking", releases_as_copied=True)})
    answer = alice_asks_to_swap(host)
    assert answer.go == () and answer.freeing == {}


def test_a_swaps_room_is_held_while_its_resume_may_still_wait_so_no_checkpoint_restore_is_given_it():
    # Bob said his park releases as it copies, then it never freed a byte before it ended (or he lied): alice's fast
    # resume waits in her kernel, up to SWAP_WAIT, and may take its memory at the last moment. Until then her room
    # is hers: bob's own restore (the checkpoint path, which a full device would break) is not given it.
    host = swap_host()
    host.lease("bob", {"kb-bob": ParkReport("parking", releases_as_copied=True)})
    assert alice_asks_to_swap(host).go == ("ka-alice",)
    host.now += reservation_timeout({UUID: 5 * GiB}) + 5.0  # past any other go's reservation
    host.lease("bob", {"kb-bob": ParkReport("parked")})
    host.kernel_used["kb-bob"] = {}
    host.room.expire(host.now, {o.grant.kernel_id for o in HELD}, 600.0)
    bobs = host.call("bob", {"kb-bob": ParkReport("waiting")}, {"kb-bob": {UUID: 5 * GiB}})
    assert bobs.go == (), bobs  # 12 - 0.6 (alice's context) - 5 (carol's) - 1 margin - 5 held for alice < 5
    assert [h.kernel_id for h in host.room.reservations()] == ["ka-alice"]
    host.now += SWAP_WAIT  # her resume's wait is over: it took the memory, or gave it back and waits again
    host.room.expire(host.now, {o.grant.kernel_id for o in HELD}, 600.0)
    assert host.call("bob", {"kb-bob": ParkReport("waiting")}, {"kb-bob": {UUID: 5 * GiB}}).go == ("kb-bob",)


def test_a_lease_report_of_the_same_park_without_the_word_does_not_undo_it():
    # Bob's server told the releasing park at once in a room call; its lease, published before the park's check,
    # arrives after it saying only "parking": still the same park, still releasing (its server will not tell again).
    host = swap_host()
    host.call("bob", {"kb-bob": ParkReport("parking", releases_as_copied=True)}, {})
    host.now += 0.2
    host.lease("bob", {"kb-bob": ParkReport("parking")})
    answer = alice_asks_to_swap(host)
    assert answer.go == ("ka-alice",) and answer.freeing, answer
