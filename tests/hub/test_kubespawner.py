"""Issue 15, the hub side, the HAMi way (the default): real KubeSpawner objects build each user's pod from the
policy (tests/hub/kube_tools.py: how, and the schema check every pod passes), and we read the manifest: the
notebook container's limits and requests, the pod's annotations and environment. The other ways:
tests/hub/test_kube_ways.py.
"""

from __future__ import annotations

import logging

import pytest
from traitlets.config import Config

from gpu_quota_ext.hub.kube import configure_kubespawner_gpu
from gpu_quota_ext.shared.sizes import PolicyError

from .kube_tools import build_pod, container, group, record_of, spawner_for

pytestmark = pytest.mark.usefixtures("no_cluster")  # every test: KubeSpawner finds no cluster

GPU, MEM, PCT, CORES = "nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores"
GPU_TYPE, GPU_POLICY = "nvidia.com/use-gputype", "hami.io/gpu-scheduler-policy"
HAMI_RESOURCES = (GPU, MEM, PCT, CORES)


def gpu_limits(pod) -> dict:
    return {k: v for k, v in (container(pod).resources.limits or {}).items() if k in HAMI_RESOURCES}


def gpu_requests(pod) -> dict:
    return {k: v for k, v in (container(pod).resources.requests or {}).items() if k in HAMI_RESOURCES}


def hami_annotations(pod) -> dict:
    return {k: v for k, v in (pod.metadata.annotations or {}).items() if k.startswith(("nvidia.com/", "hami.io/"))}


def quota_env(pod) -> dict:
    return {e.name: e.value for e in container(pod).env if e.name.startswith("GPU_QUOTA_")}


MAPPING = dict(
    default={"gpus": 1, "gpu_memory": "10GiB", "default_cap": "0.5", "max_cap": "0.5"},
    groups={
        "staff": {"gpu_memory": "40GiB", "gpu_cores": 50, "gpu_type": ["H200", "H100"], "max_cap": "1.0"},
        "students": {"gpu_memory": "25%", "gpu_scheduler_policy": "binpack", "default_cap": "0.25"},
        "no-gpu": {"gpus": 0},
    },
    users={"alice": {"gpus": 2}},
)


@pytest.fixture
def config():
    c = Config()
    # Spawner-wide values (z2jh: singleuser.extraResource): the policy replaces the GPU ones.
    c.KubeSpawner.extra_resource_limits = {GPU: "1", PCT: "100", "example.com/fpga": "1"}
    c.KubeSpawner.extra_resource_guarantees = {GPU: "1"}
    configure_kubespawner_gpu(c, **MAPPING)
    return c


async def test_each_users_pod_gets_the_policys_gpu_share(config):
    alice = await build_pod(spawner_for(config, "alice", [group("staff")]))
    assert gpu_limits(alice) == {GPU: "2", MEM: "40960", CORES: "50"}  # her own gpus, staff's memory
    assert gpu_requests(alice) == {GPU: "2"}  # a request equals its limit for extended resources
    assert container(alice).resources.limits["example.com/fpga"] == "1"  # not a GPU value: kept
    assert hami_annotations(alice) == {GPU_TYPE: "H200,H100"}
    assert quota_env(alice) == {"GPU_QUOTA_DEFAULT_CAP": "0.5", "GPU_QUOTA_MAX_CAP": "1.0"}

    bob = await build_pod(spawner_for(config, "bob", [group("students")]))
    assert gpu_limits(bob) == {GPU: "1", PCT: "25"}  # a fraction: HAMi's percentage, no MiB figure
    assert hami_annotations(bob) == {GPU_POLICY: "binpack"}
    assert quota_env(bob) == {"GPU_QUOTA_DEFAULT_CAP": "0.25", "GPU_QUOTA_MAX_CAP": "0.5"}

    # In two groups: the first in the mapping's order wins, whatever the user's own order.
    carol = await build_pod(spawner_for(config, "carol", [group("students"), group("staff")]))
    assert gpu_limits(carol) == {GPU: "1", MEM: "40960", CORES: "50"}

    dave = await build_pod(spawner_for(config, "dave"))
    assert gpu_limits(dave) == {GPU: "1", MEM: "10240"}
    assert hami_annotations(dave) == {}

    erin = await build_pod(spawner_for(config, "erin", [group("no-gpu")]))
    assert gpu_limits(erin) == {} and gpu_requests(erin) == {} and hami_annotations(erin) == {}
    assert quota_env(erin) == {"GPU_QUOTA_DEFAULT_CAP": "0.5", "GPU_QUOTA_MAX_CAP": "0.5"}


async def test_group_properties_set_the_pod_too(config):
    lab = group("lab", gpu_quota={"gpu_memory": "20GiB", "gpu_cores": "30%", "default_cap": "0.25"})
    pod = await build_pod(spawner_for(config, "frank", [lab]))
    assert gpu_limits(pod) == {GPU: "1", MEM: "20480", CORES: "30"}
    assert quota_env(pod)["GPU_QUOTA_DEFAULT_CAP"] == "0.25"


async def test_a_bad_group_property_fails_that_spawn_naming_it(config):
    spawner = spawner_for(config, "gina", [group("lab", gpu_quota={"gpu_memory": "12.5%"})])
    with pytest.raises(PolicyError) as failed:
        await build_pod(spawner)
    assert "group 'lab' property 'gpu_quota'['gpu_memory']" in str(failed.value)
    assert "whole percents" in str(failed.value)


PROFILES = [
    {"display_name": "Standard", "slug": "standard", "default": True},
    {"display_name": "Small GPU", "slug": "small", "kubespawner_override": {"extra_resource_limits": {MEM: "4096"}}},
    {
        "display_name": "Two big A100s",
        "slug": "big",
        "kubespawner_override": {
            "extra_resource_limits": {GPU: "2", MEM: "81920"},
            "extra_annotations": {GPU_TYPE: "A100"},
        },
    },
    {"display_name": "Half a GPU", "slug": "half", "kubespawner_override": {"extra_resource_limits": {PCT: "50"}}},
    {"display_name": "CPU only", "slug": "cpu", "kubespawner_override": {"extra_resource_limits": {GPU: None}}},
    {"display_name": "Broken", "slug": "broken", "kubespawner_override": {"extra_resource_limits": {MEM: "10Gi"}}},
]


@pytest.fixture
def profile_config(config):
    config.KubeSpawner.profile_list = PROFILES
    return config


@pytest.mark.parametrize(
    "profile, limits, annotations, said",
    [
        ("standard", {GPU: "1", MEM: "10240"}, {}, []),
        ("small", {GPU: "1", MEM: "4096"}, {}, []),  # a profile may offer less than the policy
        # ... never more: the policy lowers it, and the hub's log says so. The hardware choice is the profile's.
        (
            "big",
            {GPU: "1", MEM: "10240"},
            {GPU_TYPE: "A100"},
            [
                "nvidia.com/gpu 2 from the profile lowered to 1",
                "nvidia.com/gpumem 81920 from the profile lowered to 10240",
            ],
        ),
        # A percentage cannot be compared with MiB: the policy's memory replaces it.
        (
            "half",
            {GPU: "1", MEM: "10240"},
            {},
            ["nvidia.com/gpumem-percentage 50 from the profile replaced by the policy's"],
        ),
        ("cpu", {}, {}, ["the profile gives the pod no GPU"]),
    ],
)
async def test_profiles_compose_with_the_policy(profile_config, caplog, profile, limits, annotations, said):
    spawner = spawner_for(profile_config, "dave")
    with caplog.at_level(logging.INFO):
        pod = await build_pod(spawner, profile)
    assert gpu_limits(pod) == limits
    assert gpu_requests(pod) == ({GPU: limits[GPU]} if GPU in limits else {})
    assert hami_annotations(pod) == annotations
    assert container(pod).resources.limits["example.com/fpga"] == "1"
    for words in said:
        assert words in caplog.text
    assert quota_env(pod) == {"GPU_QUOTA_DEFAULT_CAP": "0.5", "GPU_QUOTA_MAX_CAP": "0.5"}


async def test_a_profile_cannot_give_a_gpu_to_a_user_the_policy_gives_none(profile_config, caplog):
    with caplog.at_level(logging.INFO):
        pod = await build_pod(spawner_for(profile_config, "erin", [group("no-gpu")]), "big")
    assert gpu_limits(pod) == {} and gpu_requests(pod) == {}
    assert (
        "nvidia.com/gpu 2, nvidia.com/gpumem 81920 from the profile removed (gpus from group 'no-gpu')" in caplog.text
    )


async def test_a_profile_value_hami_cannot_read_fails_the_spawn_naming_it(profile_config):
    with pytest.raises(PolicyError, match=r"nvidia.com/gpumem = '10Gi' is not a whole number"):
        await build_pod(spawner_for(profile_config, "dave"), "broken")


async def test_jupyterhub_group_overrides_count_as_spawner_wide_values(config):
    # Applied by JupyterHub before the pre_spawn_hook: the policy replaces the GPU values it decides.
    config.KubeSpawner.group_overrides = {
        "01-big-gpu": {
            "groups": ["staff"],
            "spawner_override": {"extra_resource_limits": {GPU: "4", "example.com/nic": "1"}},
        },
    }
    pod = await build_pod(spawner_for(config, "lena", [group("staff")]))
    assert gpu_limits(pod) == {GPU: "1", MEM: "40960", CORES: "50"}
    assert container(pod).resources.limits["example.com/nic"] == "1"


async def test_respawns_start_again_from_the_admins_values(profile_config, caplog):
    """JupyterHub makes a new spawner for a start after a clean stop, but keeps one that failed for the
    next start; KubeSpawner merges a profile into that spawner's own dicts."""
    staff = group("staff")
    spawner = spawner_for(profile_config, "hana", [staff])
    with caplog.at_level(logging.INFO):
        first = await build_pod(spawner, "big")
    assert gpu_limits(first) == {GPU: "1", MEM: "40960", CORES: "50"}
    # The profile's hardware choice wins over staff's gpu_type, said in the hub's log.
    assert hami_annotations(first) == {GPU_TYPE: "A100"}
    assert "annotation nvidia.com/use-gputype='A100' from the profile kept over the policy's 'H200,H100'" in caplog.text
    spawner.user.groups = []  # she left staff
    second = await build_pod(spawner, "standard")
    assert gpu_limits(second) == {GPU: "1", MEM: "10240"}
    assert hami_annotations(second) == {}
    assert container(second).resources.limits["example.com/fpga"] == "1"


@pytest.mark.parametrize(
    "mapping, words",
    [
        ({"groups": {"staff": {"gpu_memory": "12.5%"}}}, ["groups['staff']['gpu_memory']", "whole percents"]),
        ({"groups": {"staff": {"gpu_memory": 10240}}}, ["groups['staff']['gpu_memory']", "'10240MiB'"]),
        ({"users": {"al": {"gpus": 17}}}, ["users['al']['gpus']", "from 0 to 16"]),
        ({"users": {"al": {"gpus": True}}}, ["users['al']['gpus']", "not a whole number"]),
        ({"default": {"gpu_cores": 150}}, ["default['gpu_cores']", "from 0 to 100"]),
        ({"default": {"gpu_type": ""}}, ["default['gpu_type']"]),
        ({"default": {"gpu_type": ["H200", "{user}"]}}, ["default['gpu_type']", "braces"]),
        ({"default": {"gpu_scheduler_policy": "random"}}, ["default['gpu_scheduler_policy']", "'binpack', 'spread'"]),
        ({"default": {"node_scheduler_policy": "topology-aware"}}, ["default['node_scheduler_policy']"]),
        ({"default": {"gpu_mem": "10GiB"}}, ["default has unknown keys ['gpu_mem']", "gpu_memory"]),
        ({"default": {"gpu_memory": "lots"}}, ["default['gpu_memory']", "'lots'"]),
        ({"resource_names": {"mem": "example.com/vmem"}}, ["resource_names", "memory_percentage"]),
        # The server-side keys are checked as configure_hub_caps checks them.
        (
            {"groups": {"staff": {"gpus": 1, "default_cap": "0.9", "max_cap": "0.5"}}},
            ["groups['staff']", "above max_cap"],
        ),
    ],
)
def test_bad_entries_stop_the_hub_at_start_and_touch_no_config(mapping, words):
    c = Config()
    with pytest.raises(PolicyError) as refused:
        configure_kubespawner_gpu(c, **mapping)
    for word in words:
        assert word in str(refused.value)
    assert "pre_spawn_hook" not in c.KubeSpawner and "modify_pod_hook" not in c.KubeSpawner


async def test_the_admins_own_hooks_keep_running_first():
    calls = []

    async def admins_pre_spawn(spawner):
        calls.append("pre")
        spawner.environment = {**spawner.environment, "TEAM": "ml"}

    def admins_modify(spawner, pod):
        calls.append("modify")
        container(pod).resources.limits[MEM] = "99999"  # after the policy? no: before, and held to it
        return pod

    c = Config()
    c.Spawner.pre_spawn_hook = admins_pre_spawn
    c.KubeSpawner.modify_pod_hook = admins_modify
    configure_kubespawner_gpu(c, default={"gpus": 1, "gpu_memory": "8GiB"})
    pod = await build_pod(spawner_for(c, "ivan"))
    assert calls == ["pre", "modify"]
    assert gpu_limits(pod) == {GPU: "1", MEM: "8192"}
    assert {e.name: e.value for e in container(pod).env}["TEAM"] == "ml"


async def test_a_pod_without_the_policy_is_refused():
    """The modify hook holds no decision when the pre_spawn_hook was replaced later in the config."""
    c = Config()
    configure_kubespawner_gpu(c, default={"gpus": 1})
    c.KubeSpawner.pre_spawn_hook = None
    with pytest.raises(PolicyError, match="did not run for this spawn"):
        await build_pod(spawner_for(c, "judy"))


async def test_memory_without_a_count_asks_for_one_gpu_and_renamed_resources():
    c = Config()
    configure_kubespawner_gpu(
        c,
        default={"gpu_memory": "0.5"},
        resource_names={"count": "example.com/vgpu", "memory_percentage": "example.com/vgpu-memory-percentage"},
    )
    pod = await build_pod(spawner_for(c, "kim"))
    assert {k: v for k, v in container(pod).resources.limits.items() if k.startswith("example.com/")} == {
        "example.com/vgpu": "1",
        "example.com/vgpu-memory-percentage": "50",
    }


async def test_the_pod_keeps_kubespawners_own_limits_and_gets_the_file_its_server_reads(config):
    config.KubeSpawner.cpu_limit = 2.0
    config.KubeSpawner.mem_limit = "8G"
    config.KubeSpawner.cpu_guarantee = 1.0
    config.KubeSpawner.mem_guarantee = "4G"
    pod = await build_pod(spawner_for(config, "dave"))
    resources = container(pod).resources
    assert (resources.limits["cpu"], resources.limits["memory"]) == (2.0, 8 * 2**30)  # KubeSpawner's G is GiB
    assert (resources.requests["cpu"], resources.requests["memory"]) == (1.0, 4 * 2**30)
    assert gpu_limits(pod) == {GPU: "1", MEM: "10240"}
    # The server reads its share from HAMi's variables; the hub's record and the annotations file say what was asked.
    assert record_of(pod) == {"way": "hami", "container": "notebook", "gpus": 1, "gpu_memory": "10240Mi"}
    (volume,) = [v for v in pod.spec.volumes if v.name == "gpu-quota-pod-info"]
    items = [(i.path, i.field_ref.field_path) for i in volume.downward_api.items]
    assert items == [("annotations", "metadata.annotations")]
    (mount,) = [m for m in container(pod).volume_mounts if m.name == "gpu-quota-pod-info"]
    assert (mount.mount_path, mount.read_only) == ("/etc/gpu-quota-ext/pod", True)
