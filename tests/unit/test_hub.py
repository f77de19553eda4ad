"""The hub helper: user + groups + mapping -> the environment of the user's server. Pure; no hub runs here
(tests/hub starts a real one)."""

import asyncio
import subprocess
import sys

import pytest
from traitlets.config import Config

from gpu_quota_ext.hub import (
    HubGroup,
    caps_environment,
    choose_settings,
    configure_hub_caps,
    hub_caps,
)
from gpu_quota_ext.hub.caps import set_spawner_environment
from gpu_quota_ext.hub.kube import (
    HamiResources,
    kube_gpu,
    merge_limits,
    pod_gpu,
    settle_limits,
)
from gpu_quota_ext.shared.sizes import PolicyError

DEFAULT = "GPU_QUOTA_DEFAULT_CAP"
MAX = "GPU_QUOTA_MAX_CAP"
OVER = "GPU_QUOTA_ON_OVER_MAX"


def test_nothing_configured_sets_nothing():
    assert caps_environment(hub_caps(), "alice", ["staff"]) == {}


def test_default_applies_to_everyone():
    caps = hub_caps(default={"default_cap": "0.1", "max_cap": "25%", "on_over_max": "refuse"})
    assert caps_environment(caps, "anyone") == {DEFAULT: "0.1", MAX: "25%", OVER: "refuse"}


def test_user_entry_over_group_over_default_key_by_key():
    caps = hub_caps(
        default={"default_cap": "0.1", "max_cap": "0.2", "on_over_max": "refuse"},
        groups={"staff": {"default_cap": "0.3", "max_cap": "0.5"}},
        users={"alice": {"max_cap": "0.9"}},
    )
    assert caps_environment(caps, "alice", ["staff"]) == {DEFAULT: "0.3", MAX: "0.9", OVER: "refuse"}
    assert caps_environment(caps, "bob", ["staff"]) == {DEFAULT: "0.3", MAX: "0.5", OVER: "refuse"}
    assert caps_environment(caps, "carol", []) == {DEFAULT: "0.1", MAX: "0.2", OVER: "refuse"}
    assert caps_environment(caps, "alice", []) == {DEFAULT: "0.1", MAX: "0.9", OVER: "refuse"}


def test_first_group_of_the_mapping_wins_whatever_the_users_group_order():
    caps = hub_caps(groups={"gpu-heavy": {"default_cap": "0.5"}, "students": {"default_cap": "0.1"}})
    assert caps_environment(caps, "u", ["students", "gpu-heavy"]) == {DEFAULT: "0.5"}
    assert caps_environment(caps, "u", ["students"]) == {DEFAULT: "0.1"}


def test_group_properties_give_caps_and_update_the_mapping_entry():
    caps = hub_caps(groups={"staff": {"default_cap": "0.3", "max_cap": "0.5"}})
    staff = HubGroup("staff", {"gpu_quota": {"max_cap": "0.6"}, "other": 1})
    assert caps_environment(caps, "u", [staff]) == {DEFAULT: "0.3", MAX: "0.6"}
    # A group the mapping does not name still counts through its properties; mapped groups come first.
    lab = HubGroup("lab", {"gpu_quota": {"default_cap": "12GiB", "max_cap": "40GiB"}})
    assert caps_environment(caps, "u", [lab]) == {DEFAULT: "12GiB", MAX: "40GiB"}
    assert caps_environment(caps, "u", [lab, staff]) == {DEFAULT: "0.3", MAX: "0.6"}
    # Groups with properties but outside the mapping: by name.
    zoo = HubGroup("zoo", {"gpu_quota": {"default_cap": "0.05"}})
    assert caps_environment(hub_caps(), "u", [zoo, lab]) == {DEFAULT: "12GiB", MAX: "40GiB"}


def test_group_properties_can_be_ignored():
    caps = hub_caps(property_key=None)
    assert caps_environment(caps, "u", [HubGroup("lab", {"gpu_quota": {"default_cap": "0.5"}})]) == {}


def test_numbers_become_the_text_the_server_parses():
    caps = hub_caps(default={"default_cap": 0.125, "max_cap": 32 * 2**30, "overcommit": 1.5})
    assert caps_environment(caps, "u") == {DEFAULT: "0.125", MAX: str(32 * 2**30), "GPU_QUOTA_OVERCOMMIT": "1.5"}


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"default": {"default_cap": "lots"}}, ["default['default_cap']", "'lots'"]),
        ({"users": {"alice": {"max_cap": "2.0"}}}, ["users['alice']['max_cap']", "at most 1"]),
        ({"groups": {"staff": {"cap": "0.5"}}}, ["groups['staff']", "unknown keys ['cap']"]),
        ({"groups": {"staff": {"default_cap": "0.6", "max_cap": "0.5"}}}, ["groups['staff']", "above max_cap"]),
        ({"default": {"on_over_max": "explode"}}, ["default['on_over_max']", "'clamp', 'refuse'"]),
        ({"default": {"overcommit": "-1"}}, ["default['overcommit']", "positive"]),
        ({"default": {"default_cap": True}}, ["default['default_cap']"]),
        ({"users": ["alice"]}, ["users must be a dict"]),
        ({"groups": {"staff": "0.5"}}, ["groups['staff'] must be a dict"]),
        # Valid alone, invalid together: caught at hub start, not at a user's spawn.
        ({"default": {"default_cap": "0.1", "max_cap": "0.2"}, "groups": {"staff": {"default_cap": "0.3"}}},
         ["groups['staff'] with default", "0.3 is above max_cap 0.2"]),
        # A max_cap under the server's own default_cap (0.25) would stop every such server at start.
        ({"users": {"bob": {"max_cap": "0.1"}}},
         ["users['bob'] with default", "0.25 is above max_cap 0.1", "built-in default_cap 0.25"]),
    ],
)
def test_bad_mapping_is_refused_at_hub_start_with_its_place(kwargs, words):
    with pytest.raises(PolicyError) as raised:
        hub_caps(**kwargs)
    for word in words:
        assert word in str(raised.value)


def test_bad_group_property_fails_that_users_spawn_naming_the_group():
    caps = hub_caps(default={"max_cap": "0.5"})
    with pytest.raises(PolicyError, match=r"group 'lab' property 'gpu_quota'\['default_cap'\]"):
        caps_environment(caps, "u", [HubGroup("lab", {"gpu_quota": {"default_cap": "half"}})])
    # Valid alone, but above the default's max_cap: the message says where each value came from.
    with pytest.raises(PolicyError) as raised:
        caps_environment(caps, "u", [HubGroup("lab", {"gpu_quota": {"default_cap": "0.8"}})])
    assert "default_cap from group 'lab'" in str(raised.value)
    assert "max_cap from default" in str(raised.value)
    with pytest.raises(PolicyError, match="must be a dict"):
        caps_environment(caps, "u", [HubGroup("lab", {"gpu_quota": "0.5"})])


class FakeUser:
    def __init__(self, name, groups=()):
        self.name = name
        self.groups = list(groups)


class FakeSpawner:
    """The two attributes of jupyterhub.spawner.Spawner the hook uses."""

    def __init__(self, user, environment=None):
        self.user = user
        self.environment = dict(environment or {})


def test_hook_fills_the_spawner_environment_and_keeps_the_admins_other_variables():
    caps = hub_caps(groups={"staff": {"default_cap": "0.5", "max_cap": "0.75"}})
    spawner = FakeSpawner(FakeUser("alice", [HubGroup("staff")]), {"OTHER": "1"})
    caps.pre_spawn_hook()(spawner)
    assert spawner.environment == {"OTHER": "1", DEFAULT: "0.5", MAX: "0.75"}


def test_respawn_after_leaving_the_group_takes_back_the_groups_caps_and_restores_the_admins():
    caps = hub_caps(groups={"staff": {"default_cap": "0.5", "max_cap": "0.75"}})
    spawner = FakeSpawner(FakeUser("alice", [HubGroup("staff")]), {MAX: "0.3"})
    hook = caps.pre_spawn_hook()
    hook(spawner)
    assert spawner.environment == {DEFAULT: "0.5", MAX: "0.75"}
    spawner.user.groups = []
    hook(spawner)
    assert spawner.environment == {MAX: "0.3"}


def test_set_spawner_environment_replaces_the_dict_instead_of_mutating_a_shared_one():
    shared = {"A": "1"}
    spawner = FakeSpawner(FakeUser("u"))
    spawner.environment = shared
    set_spawner_environment(spawner, {DEFAULT: "0.2"})
    assert shared == {"A": "1"}
    assert spawner.environment == {"A": "1", DEFAULT: "0.2"}


def test_configure_sets_the_hook_in_config_and_chains_the_admins_own_hook():
    calls = []

    async def admins_hook(spawner):
        calls.append(spawner.user.name)
        spawner.environment[DEFAULT] = "0.9"  # ours runs after: the mapping decides the caps

    c = Config()
    c.Spawner.pre_spawn_hook = admins_hook
    configure_hub_caps(c, default={"default_cap": "0.2"})
    spawner = FakeSpawner(FakeUser("bob"))
    asyncio.run(c.Spawner.pre_spawn_hook(spawner))
    assert calls == ["bob"]
    assert spawner.environment[DEFAULT] == "0.2"

    plain = Config()
    configure_hub_caps(plain, users={"bob": {"default_cap": "0.3"}})
    spawner = FakeSpawner(FakeUser("bob"))
    assert plain.Spawner.pre_spawn_hook(spawner) is None  # synchronous when there is nothing to chain
    assert spawner.environment == {DEFAULT: "0.3"}


def test_configure_also_wraps_a_hook_set_on_the_spawner_classs_own_section():
    # c.KubeSpawner.pre_spawn_hook would win over c.Spawner's: ours must run there too.
    calls = []
    c = Config()
    c.KubeSpawner.pre_spawn_hook = lambda spawner: calls.append("admin")
    configure_hub_caps(c, default={"default_cap": "0.2"})
    spawner = FakeSpawner(FakeUser("bob"))
    asyncio.run(c.KubeSpawner.pre_spawn_hook(spawner))
    assert calls == ["admin"]
    assert spawner.environment == {DEFAULT: "0.2"}
    assert c.Spawner.pre_spawn_hook(FakeSpawner(FakeUser("x"))) is None


def test_configure_with_a_bad_mapping_raises_before_touching_config():
    c = Config()
    with pytest.raises(PolicyError):
        configure_hub_caps(c, groups={"staff": {"max_cap": "nope"}})
    assert "pre_spawn_hook" not in c.Spawner


@pytest.mark.parametrize("module", ["gpu_quota_ext.hub", "gpu_quota_ext.hub.kube"])
def test_importing_the_helper_does_not_import_jupyterhub(module):
    code = f"import sys, {module}; print('jupyterhub' in sys.modules, 'kubespawner' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False False"


def test_the_pods_keys_belong_to_the_kubernetes_helper_only():
    # configure_hub_caps's servers have no pod to give GPUs to: a pod key there is a mistake, said at start.
    with pytest.raises(PolicyError, match=r"default has unknown keys \['gpus'\]"):
        hub_caps(default={"gpus": 1})
    caps = kube_gpu(default={"gpus": 1, "gpu_memory": "20GB", "default_cap": "0.5"}).caps
    chosen, sources = choose_settings(caps, "u")
    assert chosen == {"gpus": "1", "gpu_memory": "19073MiB", "default_cap": "0.5"}  # whole MiB, rounded down
    assert sources == {"gpus": "default", "gpu_memory": "default", "default_cap": "default"}
    # The server's environment carries only the server's keys.
    assert caps_environment(caps, "u") == {DEFAULT: "0.5"}


def test_pod_decision_and_the_profile_rule_are_pure():
    names = HamiResources()
    chosen = {"gpus": "2", "gpu_memory": "25%", "gpu_type": "H200"}
    decision = pod_gpu(chosen, {"gpus": "g", "gpu_memory": "g", "gpu_type": "g"})
    assert decision.limits == {names.count: "2", names.memory_percentage: "25", names.memory: None}
    assert decision.annotations == {"nvidia.com/use-gputype": "H200"}
    assert merge_limits({names.memory: "1000", "cpu": "2"}, decision) == {
        names.count: "2",
        names.memory_percentage: "25",
        "cpu": "2",
    }
    # A profile asking for more is lowered; one asking for less keeps less; none means none.
    assert settle_limits({names.count: "4", names.memory_percentage: "50"}, decision)[0] == {
        names.count: "2",
        names.memory_percentage: "25",
    }
    assert settle_limits({names.count: "1", names.memory_percentage: "10"}, decision) == (
        {names.count: "1", names.memory_percentage: "10"},
        [],
    )
    assert settle_limits({names.count: "0", names.memory_percentage: "25", "cpu": "1"}, decision)[0] == {"cpu": "1"}
    no_gpu = pod_gpu({"gpus": "0", "gpu_memory": "10GiB"}, {"gpus": "g", "gpu_memory": "d"})
    assert no_gpu.no_gpu and all(value is None for value in no_gpu.limits.values())
    assert merge_limits({names.count: "1", names.memory: "10240"}, no_gpu) == {}
