"""Issue 30 item 4: a kernel kept idle that cannot be parked (its server says it is not parkable, or it declined a
park request) holds memory the broker can never give anyone else. Its user pays for it: with
unparkable_idle = "count" (the default) it counts against their user_budget once more, on top of its grant, for
their new kernels and raised caps (the book) and their resumes (reservation_over_budget); the status and the admin
page say who keeps it."""

import pytest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.hub.service.book import HostBook
from gpu_quota_ext.hub.service.limits import kept_idle, per_user, reservation_over_budget
from gpu_quota_ext.hub.service.page import render_page
from gpu_quota_ext.hub.service.status import build_status
from gpu_quota_ext.hub.service.store import Store
from gpu_quota_ext.hub.service.user_policy import UserLimits, UserPolicy
from gpu_quota_ext.ledger import AdmissionRefused
from gpu_quota_ext.policy import PolicyDecision, build_policy
from gpu_quota_ext.shared.sizes import GiB, parse_cap

DEVICE = Device(0, "Test GPU", "GPU-0", 80 * GiB, 0)
LIMITS = UserLimits(16, parse_cap("0.3"))  # 24 GiB of the device per user
T0 = 1_000_000.0


def policy(cap="8GiB"):
    return UserPolicy(PolicyDecision(parse_cap(cap), parse_cap("1.0"), 1, "test"), "refuse", LIMITS)


def report(state="idle", idle_for=600.0, parkable=False, declined=None):
    return {"state": state, "idle_for": idle_for, "parkable": parkable, "declined_park": declined}


def test_kept_idle_is_idle_long_enough_and_unparkable_or_declined_with_memory_on_the_gpu():
    used = {k: {"GPU-0": 6 * GiB} for k in "abcdefg"}
    park = {
        "a": report(),  # its server says it cannot park
        "b": report(parkable=True, declined=12.0),  # took a park request and did not carry it out
        "c": report(parkable=True),  # parkable: the broker can make room with it
        "d": report(idle_for=30.0),  # not idle long enough to be a candidate anyway
        "e": report(state="busy", idle_for=None),
        "f": report(idle_for=None),
        "g": report(),
        "h": report(),  # no memory seen on any GPU: keeps nothing
    }
    used["g"] = {"GPU-0": 0}
    assert kept_idle(park, used, min_idle=60.0) == {"a": {"GPU-0": 6 * GiB}, "b": {"GPU-0": 6 * GiB}}
    assert per_user({"a": {"GPU-0": 6 * GiB}, "b": {"GPU-0": 1}, "x": {"GPU-0": 5}}, {"a": "bob", "b": "bob"}) == {
        "bob": {"GPU-0": 6 * GiB + 1}
    }


def test_a_user_keeping_unparkable_idle_memory_has_that_much_less_budget_for_new_kernels_and_raises(tmp_path):
    store = Store(str(tmp_path), [DEVICE])
    book = HostBook([DEVICE], build_policy("8GiB", "1.0", overcommit=2.0), store, 60, 0)
    book.set_limits("bob", LIMITS)
    book.grant("bob", "", "b1", "python3", policy(), None, T0)  # 8 of 24 GiB
    book.set_kept_idle({"bob": {0: 8 * GiB}})  # b1 sits idle with 8 GiB it will not park
    book.grant("bob", "", "b2", "python3", policy(), None, T0)  # 8 + 8 + 8 kept: 24, within
    with pytest.raises(AdmissionRefused, match="could not be parked"):
        book.grant("bob", "", "b3", "python3", policy(), None, T0)
    outcome = book.change("bob", "b2", False, parse_cap("12GiB"), None)
    assert outcome.status == "refused" and "could not be parked" in outcome.message
    book.grant("alice", "", "a1", "python3", policy(), None, T0)  # another user's budget is theirs
    book.set_kept_idle({})  # b1 parked (or busy again): the budget is bob's again
    assert book.grant("bob", "", "b3", "python3", policy(), None, T0)[0].caps == {0: 8 * GiB}


def test_a_resume_of_a_user_who_keeps_unparkable_idle_memory_counts_it_once_more():
    used = {"GPU-0": 8 * GiB}  # what bob's kernels use, the unparkable one's 8 GiB among it
    claimed = {"GPU-0": 10 * GiB}  # this resume's need
    assert reservation_over_budget(used, claimed, {"GPU-0": DEVICE}, LIMITS) is None
    counted = {"GPU-0": used["GPU-0"] + 8 * GiB}  # the service's room_call adds the kept bytes (count)
    assert "would have" in reservation_over_budget(counted, claimed, {"GPU-0": DEVICE}, LIMITS)


def test_the_status_and_the_page_say_who_keeps_idle_memory_that_could_not_be_parked(tmp_path):
    store = Store(str(tmp_path), [DEVICE])
    book = HostBook([DEVICE], build_policy("8GiB", "1.0", overcommit=2.0), store, 60, 0)
    book.grant("<bob>", "", "b1", "python3", policy(), None, T0)
    book.grant("alice", "", "a1", "python3", policy(), None, T0)
    kept = [{
        "user": "<bob>", "kernel_id": "b1", "server": "", "held": {"GPU-0": 6 * GiB}, "idle_for": 900.0,
        "declined_park": 40.0, "counted": True,
    }]
    status = build_status(book, None, "ok", [], {}, "carol", True, T0, {"kept_idle": kept})
    users = {u["name"]: u for u in status["users"]}
    assert users["<bob>"]["kept_idle"] == 6 * GiB and users["alice"]["kept_idle"] == 0
    page = render_page(status)
    assert "Idle memory that could not be parked" in page
    assert "<td>&lt;bob&gt;</td><td>b1</td>" in page and "declined a park request 40 s ago" in page
    assert "<td>6.0 GiB</td>" in page and "yes, once more" in page
    alice = build_status(book, None, "ok", [], {}, "alice", False, T0, {"kept_idle": []})
    assert alice["kept_idle"] == []


@pytest.mark.parametrize("setting", ["count", "show"])
def test_the_service_notes_kept_idle_memory_at_each_sample_and_counts_it_as_its_setting_says(tmp_path, setting):
    from types import SimpleNamespace

    from gpu_quota_ext.hub.service.app import GpuQuotaService
    from gpu_quota_ext.hub.service.room import ParkReport

    from .host_service import service_config

    app = GpuQuotaService(config=service_config(tmp_path, uuid="GPU-0", unparkable_idle=setting))
    app.build()
    try:
        app.book.grant("bob", "", "b1", "python3", policy(), None, T0)
        app.book.grant("bob", "", "b2", "python3", policy(), None, T0)
        reports = {"b1": ParkReport("idle", 600.0, False), "b2": ParkReport("idle", 600.0, True)}
        app.broker.room.hear("bob", "", reports, T0, lease=True)
        used = {"b1": {"GPU-0": 6 * GiB}, "b2": {"GPU-0": GiB}}
        sample = SimpleNamespace(attributed=SimpleNamespace(kernel_used=used))
        app.broker.note_kept_idle(sample, T0 + 1)
        assert app.broker.kept_idle == {"b1": {"GPU-0": 6 * GiB}}  # b2 can park: the broker can make room with it
        assert app.book.kept_idle_of("bob") == ({0: 6 * GiB} if setting == "count" else {})
        (row,) = app.status_now("carol", True)["kept_idle"]
        assert (row["user"], row["kernel_id"], row["counted"]) == ("bob", "b1", setting == "count")
        assert app.status_now("alice", False)["kept_idle"] == []  # another user's: not alice's business
    finally:
        app.store.close()
