"""Each user's policy on the host comes from the hub's mapping (users, groups, group properties), layered
as configure_hub_caps does; what the mapping leaves open is the service's own setting."""

import pytest

from gpu_quota_ext.hub import HubGroup, hub_caps
from gpu_quota_ext.hub.service.user_policy import user_policy
from gpu_quota_ext.policy import build_policy
from gpu_quota_ext.shared.sizes import PolicyError

HOST = build_policy("0.1", "0.5", overcommit=1.0, on_full="cpu-only")
CAPS = hub_caps(
    default={"default_cap": "0.25", "max_cap": "0.5"},
    groups={"staff": {"default_cap": "0.5", "max_cap": "1.0", "on_full": "refuse"}, "students": {"max_cap": "0.25"}},
    users={"alice": {"max_cap": "0.75"}},
)


def test_a_users_entry_wins_then_their_group_then_the_default():
    alice = user_policy(CAPS, HOST, "alice", ["staff"])
    assert (str(alice.decision.cap), str(alice.decision.max_cap), alice.on_full) == ("0.5", "0.75", "refuse")
    assert "max_cap from users['alice']" in alice.decision.source and "group 'staff'" in alice.decision.source
    student = user_policy(CAPS, HOST, "sam", ["students"])
    assert (str(student.decision.cap), str(student.decision.max_cap), student.on_full) == ("0.25", "0.25", "cpu-only")
    nobody = user_policy(CAPS, HOST, "eve", [])
    assert (str(nobody.decision.cap), str(nobody.decision.max_cap)) == ("0.25", "0.5")


def test_the_first_group_in_the_mappings_order_wins():
    both = user_policy(CAPS, HOST, "bob", ["students", "staff"])
    assert str(both.decision.max_cap) == "1.0"  # staff comes first in the mapping


def test_a_group_property_set_in_the_hub_counts_live():
    group = HubGroup("students", {"gpu_quota": {"default_cap": "0.1", "max_cap": "0.2"}})
    policy = user_policy(CAPS, HOST, "sam", [group])
    assert (str(policy.decision.cap), str(policy.decision.max_cap)) == ("0.1", "0.2")


def test_what_the_mapping_leaves_open_is_the_services_setting():
    policy = user_policy(hub_caps(), HOST, "eve", [])
    assert (str(policy.decision.cap), str(policy.decision.max_cap), policy.on_full) == ("0.1", "0.5", "cpu-only")
    assert policy.decision.source == "hub: the service's defaults"


def test_a_hosts_default_above_a_users_max_cap_is_held_to_it():
    caps = hub_caps(users={"sam": {"max_cap": "0.3"}})
    policy = user_policy(caps, build_policy("0.5", "1.0"), "sam", [])
    assert (str(policy.decision.cap), str(policy.decision.max_cap)) == ("0.3", "0.3")


def test_a_bad_group_property_is_a_clear_error_naming_it():
    group = HubGroup("students", {"gpu_quota": {"default_cap": "lots"}})
    with pytest.raises(PolicyError, match="students"):
        user_policy(CAPS, HOST, "sam", [group])
