"""Issue 28: the host service holds one account of the host's memory for every user's parks; its admin's status says
how much of it is promised to parks under way (`host_memory`), so an admin (and a test through a real hub) can see a
promise end with its park. A user's status does not show it: the parks are other users' too."""


from gpu_quota_ext.hub.service.app import GpuQuotaService
from gpu_quota_ext.hub.service.room import ParkReport
from gpu_quota_ext.hub.service.user_policy import UserLimits, UserPolicy
from gpu_quota_ext.parking import HostReading
from gpu_quota_ext.policy import PolicyDecision
from gpu_quota_ext.shared.sizes import GiB, parse_cap

from .host_service import service_config

T0 = 1_000_000.0


def test_the_admins_status_shows_the_host_memory_promised_to_parks_under_way_until_the_park_ends(tmp_path):
    app = GpuQuotaService(config=service_config(tmp_path, uuid="GPU-0"))
    app.build()
    try:
        policy = UserPolicy(PolicyDecision(parse_cap("8GiB"), parse_cap("1.0"), 1, "test"), "refuse", UserLimits(16))
        app.book.grant("bob", "", "kb", "python3", policy, None, T0)
        assert app.status_now("carol", True)["host_memory"] == {"promised": 0}
        assert app.broker.room.promise_host("kb", 5 * GiB, HostReading(20 * GiB, None), 2 * GiB, T0) is None
        assert app.status_now("carol", True)["host_memory"] == {"promised": 5 * GiB}
        assert "host_memory" not in app.status_now("bob", False)  # every user's parks: the admin's to see
        app.broker.room.hear("bob", "", {"kb": ParkReport("parked", None, False)}, T0 + 2, lease=True)
        assert app.status_now("carol", True)["host_memory"] == {"promised": 0}  # parked: the host's reading has it
    finally:
        app.store.close()
