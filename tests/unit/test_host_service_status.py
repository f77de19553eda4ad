"""What the status, the admin's page and the Prometheus gauges show: every user's kernels to an admin,
only their own to a user; usage from the host sample; unmanaged usage per user; a refused PID registration
(with whose the process is to the admin only); values escaped."""

from prometheus_client.exposition import generate_latest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.hub.service.attribution import GpuProcess, attribute, verify
from gpu_quota_ext.hub.service.book import HostBook
from gpu_quota_ext.hub.service.metrics import registry_for
from gpu_quota_ext.hub.service.page import render_page
from gpu_quota_ext.hub.service.sampler import Action, Sample
from gpu_quota_ext.hub.service.status import build_status
from gpu_quota_ext.hub.service.user_policy import UserPolicy
from gpu_quota_ext.policy import PolicyDecision, build_policy
from gpu_quota_ext.shared.sizes import GiB, parse_cap

DEVICE = Device(0, "Test GPU", "GPU-a", 80 * GiB, 0)
POLICY = UserPolicy(PolicyDecision(parse_cap("0.25"), parse_cap("0.5"), 1, "test"), "cpu-only")


class Journal:
    def __getattr__(self, name):
        return lambda *args: None


def scene():
    book = HostBook([DEVICE], build_policy("0.25", "1.0", overcommit=1.0), Journal(), 60, 0)
    book.grant("alice", "", "ka", "python3", POLICY, None, 100.0)
    book.grant("<bob>", "", "kb", "python3", POLICY, None, 100.0)
    book.lease("alice", "", {"ka": (10,)}, 100.0)
    book.lease("<bob>", "", {"kb": (10,)}, 100.0)  # alice's process, named by bob's server: refused
    verified = verify(book.registrations(), {10: 1000}, {"alice": 1000, "<bob>": 1001})
    processes = [
        GpuProcess(10, "GPU-a", 30 * GiB, 1000, "alice", "ka"),
        GpuProcess(20, "GPU-a", 5 * GiB, 1001, "<bob>", None),
    ]
    granted = {"ka": ("alice", ("GPU-a",)), "kb": ("<bob>", ("GPU-a",))}
    sample = Sample(
        101.0, {"GPU-a": 35 * GiB}, tuple(processes), attribute(processes, granted, "{username}"), None, verified
    )
    actions = [Action(101.0, "warn", "<bob>", 20, "GPU-a", 5 * GiB, "PID 20 of <bob> holds memory outside every grant")]
    return book, sample, actions


def test_an_admin_sees_everyone_and_a_user_only_themselves():
    book, sample, actions = scene()
    policies = {"alice": POLICY}
    admin = build_status(book, sample, "ok", actions, policies, "carol", True, 102.0)
    assert {k["kernel_id"] for k in admin["kernels"]} == {"ka", "kb"}
    users = {u["name"]: u for u in admin["users"]}
    assert users["alice"]["used"] == 30 * GiB and users["alice"]["granted"] == 20 * GiB
    assert users["alice"]["policy"]["max_cap"] == "0.5"
    assert users["<bob>"]["unmanaged"] == 5 * GiB
    ka = next(k for k in admin["kernels"] if k["kernel_id"] == "ka")
    assert ka["over_cap"] and ka["pids"] == [10] and ka["devices"][0]["used"] == 30 * GiB
    assert admin["devices"][0]["used"] == 35 * GiB and len(admin["actions"]) == 1
    kb = next(k for k in admin["kernels"] if k["kernel_id"] == "kb")
    assert kb["registered_pids"] == [10] and kb["pids"] == [] and kb["devices"][0]["used"] is None
    (refused,) = admin["refused_pids"]
    assert (refused["user"], refused["pid"], refused["uid"]) == ("<bob>", 10, 1000) and "uid 1001" in refused["why"]

    alice = build_status(book, sample, "ok", actions, policies, "alice", False, 102.0)
    assert [k["kernel_id"] for k in alice["kernels"]] == ["ka"]
    assert [u["name"] for u in alice["users"]] == ["alice"]
    assert alice["unmanaged"] == [] and alice["actions"] == []
    assert alice["devices"][0]["used"] is None  # the whole device's usage says something of others
    assert alice["refused_pids"] == []
    bob = build_status(book, sample, "ok", actions, policies, "<bob>", False, 102.0)
    (refused,) = bob["refused_pids"]
    assert "uid" not in refused and "1000" not in refused["why"]  # whose the process is: not bob's business


def test_the_page_escapes_every_value():
    book, sample, actions = scene()
    page = render_page(build_status(book, sample, "ok", actions, {}, "carol", True, 102.0))
    assert "&lt;bob&gt;" in page and "<bob>" not in page
    assert "<td>ka</td>" in page and "<td>yes</td>" in page  # ka uses more than its cap
    assert "Refused PID registrations" in page and "runs as uid 1000, not as &lt;bob&gt;" in page


def test_the_gauges_are_per_user_and_kernel_and_follow_the_ledger():
    book, sample, actions = scene()
    registry = registry_for(lambda: build_status(book, sample, "ok", actions, {}, "metrics", True, 102.0))
    text = generate_latest(registry).decode()
    assert 'gpu_quota_host_kernel_cap_bytes{device="GPU-a",kernel_id="ka",user="alice"} 2.147483648e+10' in text
    assert 'gpu_quota_host_user_unmanaged_bytes{user="<bob>"}' in text
    book.release("alice", "ka", False)
    assert 'kernel_id="ka"' not in generate_latest(registry).decode()


def test_each_users_usage_and_grants_over_time_are_kept_bounded_and_charted_on_the_page():
    from gpu_quota_ext.hub.service.history import UserHistory, user_points

    book, sample, actions = scene()
    history = UserHistory(points_max=3)
    for t in (101.0, 106.0, 111.0, 116.0):
        status = build_status(book, sample, "ok", actions, {}, "history", True, t)
        status["sampled_at"] = t  # a sample every 5 s
        history.record(user_points(status, sampled=True))
    kept = history.points(["alice", "<bob>", "carol"])
    assert sorted(kept) == ["<bob>", "alice"]  # carol has no row, so no history
    assert [p["t"] for p in kept["alice"]] == [106.0, 111.0, 116.0]  # the oldest dropped past points_max
    assert kept["alice"][-1]["used"] == 30 * GiB and kept["alice"][-1]["cap"] == 20 * GiB
    assert kept["<bob>"][-1]["used"] == 5 * GiB  # all of a user's processes: bob's unmanaged one too

    # A sample in which NVML read no device: the usage is unknown, not 0.
    unread = build_status(book, sample, "ok", actions, {}, "history", True, 121.0)
    unread["sampled_at"] = 121.0
    history.record(user_points(unread, sampled=False))
    assert history.points(["alice"])["alice"][-1]["used"] is None

    # A user the status no longer lists is forgotten.
    book.release("<bob>", "kb", False)
    later = build_status(book, None, "ok", [], {}, "history", True, 126.0)
    later["sampled_at"] = 126.0
    history.record(user_points(later, sampled=False))
    assert sorted(history.points(["alice", "<bob>"])) == ["alice"]

    status = build_status(book, sample, "ok", actions, {}, "carol", True, 102.0)
    page = render_page(status, {"alice": kept["alice"], "<bob>": kept["<bob>"]}, 5.0)
    assert "Usage over the last minutes, per user" in page
    assert page.count('<svg class="gpu-quota-chart"') == 2
    assert "<th>&lt;bob&gt;</th>" in page and "<bob>" not in page
    assert "Granted (dashed): 20.0 GiB" in page and "NVML used, all the user&#x27;s processes (line): 30.0 GiB" in page
    assert "Allocator" not in page  # the service has no allocator figures: not said at all
    assert "Usage over the last minutes" not in render_page(status)
