"""Issue 33: the same policy through HAMi-DRA, NVIDIA's DRA driver and KAI's GPU fractions (the HAMi way:
test_kubespawner.py). Real KubeSpawner objects build each pod (tests/hub/kube_tools.py), every pod and every
ResourceClaimTemplate is checked against the strict Kubernetes API schema of each version the docs name, the
templates go through KubeSpawner's own API client to a stand-in API server, and each pod's claims, annotations
and limits are compared with the policy for a table of users, groups and profiles.

Then the pod side of the same objects: what the cluster would put in the container (the kubelet's downward API
file, the DRA drivers' CDI variables, KAI's) faked from the built pod and read by the server's own reader.
"""

from __future__ import annotations

import json
import logging

import kubernetes_validate
import pytest
from traitlets.config import Config

from gpu_quota_ext.devices.downward import parse_annotations
from gpu_quota_ext.devices.pod_share import read_share
from gpu_quota_ext.hub.kube import ClaimTemplateError, configure_kubespawner_gpu
from gpu_quota_ext.shared.sizes import MiB, PolicyError

from .kube_tools import DRA_VERSIONS, build_pod, container, group, kubelet_annotations_file, record_of, spawner_for

pytestmark = pytest.mark.usefixtures("no_cluster")  # every test: KubeSpawner finds no cluster

GPU, MEM, PCT, CORES = "nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores"
HAMI_RESOURCES = (GPU, MEM, PCT, CORES)
GPU_TYPE = "nvidia.com/use-gputype"

DRA_MAPPING = dict(
    default={"gpus": 1, "gpu_memory": "10GiB", "default_cap": "0.5", "max_cap": "0.5"},
    groups={
        "staff": {"gpu_memory": "40GiB", "gpu_cores": 50, "gpu_type": ["H200", "H100"], "max_cap": "1.0"},
        "students": {"gpu_memory": "4GiB", "default_cap": "0.25"},
        "no-gpu": {"gpus": 0},
    },
    users={"alice": {"gpus": 2}},
)
KAI_MAPPING = dict(
    default={"gpus": 1, "gpu_memory": "10GiB", "kai_queue": "research", "default_cap": "0.5", "max_cap": "0.5"},
    groups={
        "staff": {"gpu_memory": "40GiB", "kai_queue": "staff", "max_cap": "1.0"},
        "students": {"gpu_memory": "25%", "kai_queue": "teaching", "default_cap": "0.25"},
        "no-gpu": {"gpus": 0},
    },
    users={"alice": {"gpus": 2}},
)
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
    # Profiles in KAI's own words.
    {
        "display_name": "KAI half",
        "slug": "kai-half",
        "kubespawner_override": {"extra_annotations": {"gpu-fraction": "0.5"}},
    },
    {
        "display_name": "KAI small",
        "slug": "kai-small",
        "kubespawner_override": {"extra_annotations": {"gpu-memory": "4096"}},
    },
    {
        "display_name": "KAI big",
        "slug": "kai-big",
        "kubespawner_override": {"extra_annotations": {"gpu-memory": "81920"}},
    },
]


def configured(way: str, mapping: dict, *, host: str = "", **more) -> Config:
    c = Config()
    # Spawner-wide values (z2jh: singleuser.extraResource, cpu and memory): the way's objects replace the GPU ones.
    c.KubeSpawner.extra_resource_limits = {GPU: "1", PCT: "100", "example.com/fpga": "1"}
    c.KubeSpawner.extra_resource_guarantees = {GPU: "1"}
    c.KubeSpawner.cpu_limit = 4.0
    c.KubeSpawner.mem_limit = "16G"
    c.KubeSpawner.profile_list = PROFILES
    if host:
        c.KubeSpawner.k8s_api_host = host
    configure_kubespawner_gpu(c, way=way, **mapping, **more)
    return c


def limits_of(pod) -> dict:
    return dict(container(pod).resources.limits or {})


def claims_of(pod) -> list:
    """[(claim name, template)] of the pod and [(claim, request)] of the notebook container."""
    pod_claims = [(c.name, c.resource_claim_template_name) for c in pod.spec.resource_claims or []]
    used = [(c.name, c.request) for c in container(pod).resources.claims or []]
    return [pod_claims, used]


def template_of(pod, api) -> dict:
    """The ResourceClaimTemplate the pod names, as the stand-in API server received it."""
    ((_, name),) = claims_of(pod)[0]
    (found,) = [body for key, body in api.templates.items() if key.rpartition("/")[2] == name]
    return found


def request_of(template: dict) -> dict:
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["name"] == "gpu"
    return request["exactly"]


# --- HAMi-DRA and NVIDIA's DRA driver ------------------------------------------------------------------------

H200_H100 = (
    "device.attributes['{d}'].productName.lowerAscii().contains('h200') || "
    "device.attributes['{d}'].productName.lowerAscii().contains('h100')"
)
USERS = [
    # user, groups, GPUs, MiB of each, cores, models
    ("alice", ["staff"], 2, 40960, 50, H200_H100),  # her own gpus, staff's memory, cores and models
    ("bob", ["students"], 1, 4096, None, None),
    ("carol", ["students", "staff"], 1, 40960, 50, H200_H100),  # the mapping's group order wins
    ("dave", [], 1, 10240, None, None),
    ("erin", ["no-gpu"], 0, None, None, None),
]


@pytest.mark.parametrize("user, groups, gpus, mib, cores, models", USERS)
async def test_hami_dra_claims_the_policys_share_as_capacity(fake_api, user, groups, gpus, mib, cores, models):
    config = configured("hami-dra", DRA_MAPPING, host=fake_api.host)
    spawner = spawner_for(config, user, [group(g) for g in groups])
    pod = await build_pod(spawner)
    assert not set(limits_of(pod)) & set(HAMI_RESOURCES)  # no device-plugin GPU beside the claim
    assert limits_of(pod)["example.com/fpga"] == "1" and limits_of(pod)["cpu"] == 4.0  # KubeSpawner's own stay
    assert not set(container(pod).resources.requests or {}) & set(HAMI_RESOURCES)
    if gpus == 0:
        assert claims_of(pod) == [[], []] and fake_api.posts == []
        assert record_of(pod) == {"way": "hami-dra", "container": "notebook", "gpus": 0}
        return
    ((claim, template),), used = claims_of(pod)
    assert claim == "gpu-quota" and used == [("gpu-quota", "gpu")]
    assert template.startswith("gpu-quota-hami-dra-")
    sent = template_of(pod, fake_api)
    exactly = request_of(sent)
    assert (exactly["deviceClassName"], exactly["allocationMode"], exactly["count"]) == (
        "hami-core-gpu.project-hami.io",
        "ExactCount",
        gpus,
    )
    # No gpu_cores: cores 0 (HAMi's default), else the driver's default, all 100, would keep the GPU to this pod.
    wanted = {"memory": f"{mib}Mi", "cores": str(cores) if cores is not None else "0"}
    assert exactly["capacity"] == {"requests": wanted}
    if models:
        assert exactly["selectors"] == [{"cel": {"expression": models.format(d="hami-core-gpu.project-hami.io")}}]
    else:
        assert "selectors" not in exactly
    constraints = sent["spec"]["spec"]["devices"].get("constraints")
    # Two GPUs of a device that allows several allocations: the same GPU must not serve both.
    assert constraints == (
        [{"requests": ["gpu"], "distinctAttribute": "hami-core-gpu.project-hami.io/uuid"}] if gpus > 1 else None
    )
    assert fake_api.posts == [f"{spawner.namespace}/{template}"]  # in the user's namespace
    assert record_of(pod)["claim"] == template and record_of(pod)["gpu_memory"] == f"{mib}Mi"
    assert GPU_TYPE not in (pod.metadata.annotations or {})  # the model is the claim's selector now


@pytest.mark.parametrize("user, groups, gpus, mib, cores, models", USERS)
async def test_nvidia_dra_claims_whole_gpus_with_the_policys_mps_limit(
    fake_api, user, groups, gpus, mib, cores, models
):
    config = configured("nvidia-dra", DRA_MAPPING, host=fake_api.host)
    pod = await build_pod(spawner_for(config, user, [group(g) for g in groups]))
    assert not set(limits_of(pod)) & set(HAMI_RESOURCES)
    if gpus == 0:
        assert claims_of(pod) == [[], []] and fake_api.posts == []
        return
    sent = template_of(pod, fake_api)
    exactly = request_of(sent)
    assert (exactly["deviceClassName"], exactly["count"]) == ("gpu.nvidia.com", gpus)
    assert "capacity" not in exactly  # NVIDIA's driver gives whole devices: the share is the MPS limit
    (config_entry,) = sent["spec"]["spec"]["devices"]["config"]
    assert config_entry["requests"] == ["gpu"] and config_entry["opaque"]["driver"] == "gpu.nvidia.com"
    mps = {
        "defaultPinnedDeviceMemoryLimit": f"{mib}Mi",
        **({"defaultActiveThreadPercentage": cores} if cores is not None else {}),
    }
    assert config_entry["opaque"]["parameters"] == {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": mps},
    }
    if models:
        assert exactly["selectors"] == [{"cel": {"expression": models.format(d="gpu.nvidia.com")}}]


@pytest.mark.parametrize(
    "profile, mib, models, said",
    [
        ("standard", 10240, None, []),
        ("small", 4096, None, []),  # a profile may offer less than the policy
        # ... never more; its choice of hardware stays (as a selector)
        (
            "big",
            10240,
            "a100",
            [
                "nvidia.com/gpu 2 from the profile lowered to 1",
                "nvidia.com/gpumem 81920 from the profile lowered to 10240",
            ],
        ),
        ("half", 10240, None, ["nvidia.com/gpumem-percentage 50 from the profile replaced by the policy's"]),
        ("cpu", None, None, ["the profile gives the pod no GPU"]),
    ],
)
async def test_dra_profiles_offer_less_never_more(fake_api, caplog, profile, mib, models, said):
    config = configured("hami-dra", DRA_MAPPING, host=fake_api.host)
    with caplog.at_level(logging.INFO):
        pod = await build_pod(spawner_for(config, "dave"), profile)
    for words in said:
        assert words in caplog.text
    if mib is None:
        assert claims_of(pod) == [[], []]
        return
    exactly = request_of(template_of(pod, fake_api))
    assert (exactly["count"], exactly["capacity"]["requests"]["memory"]) == (1, f"{mib}Mi")
    if models:
        assert models in exactly["selectors"][0]["cel"]["expression"]


async def test_one_template_per_distinct_claim_created_through_the_api_client(fake_api):
    config = configured("hami-dra", DRA_MAPPING, host=fake_api.host)
    first = await build_pod(spawner_for(config, "dave"))
    again = await build_pod(spawner_for(config, "gina"))  # the same policy: the same template (409 is fine)
    other = await build_pod(spawner_for(config, "bob", [group("students")]))
    assert claims_of(first) == claims_of(again) != claims_of(other)
    assert len(fake_api.posts) == 3 and len(fake_api.templates) == 2 and fake_api.problems == []


async def test_a_template_the_hub_may_not_create_fails_the_spawn_saying_what_to_apply(fake_api):
    fake_api.status = 403
    config = configured("nvidia-dra", DRA_MAPPING, host=fake_api.host)
    with pytest.raises(ClaimTemplateError, match="may not create resourceclaimtemplates .* apply the Role"):
        await build_pod(spawner_for(config, "dave"))


async def test_a_claim_merges_with_the_admins_own_claims_and_resources(fake_api):
    def admins_modify(spawner, pod):
        from kubernetes_asyncio.client import CoreV1ResourceClaim, V1PodResourceClaim

        pod.spec.resource_claims = [V1PodResourceClaim(name="nic", resource_claim_template_name="rdma")]
        container(pod).resources.claims = [CoreV1ResourceClaim(name="nic")]
        return pod

    config = configured("hami-dra", DRA_MAPPING, host=fake_api.host)
    config.KubeSpawner.modify_pod_hook = admins_modify
    configure_kubespawner_gpu(config, way="hami-dra", **DRA_MAPPING)  # after the admin's hook, as the docs say
    pod = await build_pod(spawner_for(config, "dave"))
    pod_claims, used = claims_of(pod)
    assert pod_claims[0] == ("nic", "rdma") and pod_claims[1][0] == "gpu-quota"
    assert used == [("nic", None), ("gpu-quota", "gpu")]
    assert limits_of(pod)["cpu"] == 4.0 and limits_of(pod)["memory"] == 16 * 2**30


# --- KAI ------------------------------------------------------------------------------------------------------


def kai_annotations(pod) -> dict:
    prefixes = ("gpu-", "nvidia.com/container.")
    found = {k: v for k, v in (pod.metadata.annotations or {}).items() if k.startswith(prefixes)}
    found.pop("gpu-quota-ext/pod-gpu")  # the hub's record: record_of()
    return found


def fraction_of(memory: str, gpus: int, queue: str) -> dict:
    wanted = {"gpu-fraction-container-name": "notebook"}
    if gpus > 1:
        wanted["gpu-fraction-num-devices"] = str(gpus)
    if memory.endswith("%"):
        wanted["gpu-fraction"] = f"{int(memory[:-1]) / 100:.2f}"
    else:
        wanted["gpu-memory"] = memory
        wanted["nvidia.com/container.notebook.gpu-memory.limit"] = memory + "Mi"
        wanted["nvidia.com/container.notebook.gpu-memory.request"] = memory + "Mi"
    return wanted


@pytest.mark.parametrize(
    "user, groups, gpus, memory, queue",
    [
        ("alice", ["staff"], 2, "40960", "staff"),
        ("bob", ["students"], 1, "25%", "teaching"),
        ("carol", ["students", "staff"], 1, "40960", "staff"),
        ("dave", [], 1, "10240", "research"),
        ("erin", ["no-gpu"], 0, None, "research"),
    ],
)
async def test_kai_pods_go_to_the_users_queue_with_the_policys_fraction(user, groups, gpus, memory, queue):
    pod = await build_pod(spawner_for(configured("kai", KAI_MAPPING), user, [group(g) for g in groups]))
    assert pod.spec.scheduler_name == "kai-scheduler"
    assert pod.metadata.labels["kai.scheduler/queue"] == queue
    assert not set(limits_of(pod)) & set(HAMI_RESOURCES)  # a fraction is KAI's, not the device plugin's
    assert limits_of(pod)["example.com/fpga"] == "1"
    assert kai_annotations(pod) == (fraction_of(memory, gpus, queue) if gpus else {})
    assert claims_of(pod) == [[], []]


@pytest.mark.parametrize(
    "profile, annotations, said",
    [
        ("kai-small", fraction_of("4096", 1, "research"), ["the profile's gpu-memory=4096 read as nvidia.com/gpumem"]),
        ("kai-big", fraction_of("10240", 1, "research"), ["nvidia.com/gpumem 81920 from the profile lowered to 10240"]),
        # A fraction cannot be compared with MiB: the policy's size replaces it, as for HAMi's percentage.
        ("kai-half", fraction_of("10240", 1, "research"), ["replaced by the policy's"]),
        ("small", fraction_of("4096", 1, "research"), []),
        ("cpu", {}, ["the profile gives the pod no GPU"]),
    ],
)
async def test_kai_profiles_offer_less_never_more(caplog, profile, annotations, said):
    with caplog.at_level(logging.INFO):
        pod = await build_pod(spawner_for(configured("kai", KAI_MAPPING), "dave"), profile)
    assert kai_annotations(pod) == annotations
    for words in said:
        assert words in caplog.text


async def test_kai_whole_gpus_stay_the_device_plugins_resource():
    config = configured("kai", {"default": {"gpus": 2, "kai_queue": "q"}})
    pod = await build_pod(spawner_for(config, "dave"))
    assert limits_of(pod)[GPU] == "2" and container(pod).resources.requests[GPU] == "2"
    assert kai_annotations(pod) == {} and pod.metadata.labels["kai.scheduler/queue"] == "q"


# --- what each way cannot carry, said at hub start --------------------------------------------------------------


@pytest.mark.parametrize(
    "way, mapping, words",
    [
        ("hami-dra", {"default": {"gpu_memory": "25%"}}, ["default['gpu_memory'] = '25%'", "in bytes"]),
        ("nvidia-dra", {"groups": {"g": {"gpu_scheduler_policy": "binpack"}}}, ["groups['g']['gpu_scheduler_policy']"]),
        ("kai", {"default": {"kai_queue": "q", "gpu_cores": 50}}, ["default['gpu_cores']", "not a compute share"]),
        ("kai", {"default": {"kai_queue": "q", "gpu_type": "H200"}}, ["default['gpu_type']", "node selector"]),
        ("kai", {"default": {"kai_queue": "no spaces"}}, ["default['kai_queue']", "label value"]),
        ("hami", {"default": {"kai_queue": "q"}}, ["default['kai_queue']", "only the 'kai' way"]),
        ("slurm", {}, ["way='slurm'", "'hami', 'hami-dra', 'kai', 'nvidia-dra'"]),
        ("hami", {"device_class": "x"}, ["device_class='x'", "DRA ways only"]),
    ],
)
def test_what_a_way_cannot_carry_stops_the_hub_at_start(way, mapping, words):
    c = Config()
    with pytest.raises(PolicyError) as refused:
        configure_kubespawner_gpu(c, way=way, **mapping)
    for word in words:
        assert word in str(refused.value)
    assert "pre_spawn_hook" not in c.KubeSpawner


async def test_a_kai_user_without_a_queue_and_a_bad_group_property_fail_that_spawn():
    config = configured("kai", {"groups": {"staff": {"kai_queue": "staff"}}})
    with pytest.raises(PolicyError, match="user 'dave' has no kai_queue"):
        await build_pod(spawner_for(config, "dave"))
    lab = group("lab", gpu_quota={"gpu_memory": "25%"})
    with pytest.raises(PolicyError, match=r"gpu_memory from group 'lab'.*in bytes"):
        await build_pod(spawner_for(configured("hami-dra", DRA_MAPPING), "frank", [lab]))


# --- the pod side: what the cluster would put in the container, read by the server's own reader --------------


async def test_kai_the_server_reads_its_share_from_the_annotations_file():
    pod = await build_pod(spawner_for(configured("kai", KAI_MAPPING), "dave"))
    annotations = parse_annotations(kubelet_annotations_file(pod))
    share, warning = read_share({}, annotations)  # KAI alone: scheduled for it, enforced by nothing
    assert (share.way, share.every_device, share.enforced, warning) == ("kai", 10240 * MiB, False, None)
    # kai-gpu-fractioning turns the per-container limit annotation into NVIDIA_GPU_MEMORY_LIMITS (whole MiB).
    limit = annotations["nvidia.com/container.notebook.gpu-memory.limit"]
    share, _ = read_share({"NVIDIA_GPU_MEMORY_LIMITS": str(int(limit[:-2]))}, annotations)
    assert (share.every_device, share.enforced_by) == (
        10240 * MiB,
        "the NVIDIA driver (r615+ memory limit, kai-gpu-fractioning)",
    )
    students = await build_pod(spawner_for(configured("kai", KAI_MAPPING), "bob", [group("students")]))
    share, _ = read_share({}, parse_annotations(kubelet_annotations_file(students)))
    assert (share.fraction, share.limit_for(0, 80 * 1024 * MiB)) == (0.25, 20 * 1024 * MiB)


async def test_nvidia_dra_the_server_reads_the_claims_mps_limit_from_the_record(fake_api):
    pod = await build_pod(spawner_for(configured("nvidia-dra", DRA_MAPPING, host=fake_api.host), "dave"))
    annotations = parse_annotations(kubelet_annotations_file(pod))
    share, _ = read_share({"CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps"}, annotations)  # the driver's CDI edit
    assert (share.way, share.every_device, share.scope, share.enforced) == ("nvidia-dra", 10240 * MiB, "process", True)
    assert record_of(pod)["claim"] in share.fallback_source
    share, _ = read_share({}, annotations)  # the claim was prepared without MPS: nothing holds the pod to it
    assert not share.enforced and "MPSSupport" in share.off_reason


async def test_hami_dra_the_server_reads_what_the_driver_makes_of_the_claims_capacity(fake_api):
    pod = await build_pod(
        spawner_for(configured("hami-dra", DRA_MAPPING, host=fake_api.host), "alice", [group("staff")])
    )
    exactly = request_of(template_of(pod, fake_api))
    mib = int(exactly["capacity"]["requests"]["memory"][:-2])
    # HAMi's DRA driver: per device of the claim, CUDA_DEVICE_MEMORY_LIMIT_<i>=<MiB>m and CUDA_DEVICE_SM_LIMIT_<i>.
    env = {"CUDA_DEVICE_MEMORY_SHARED_CACHE": "/usr/local/vgpu/claims/0b1c/6a.cache"}
    for i in range(exactly["count"]):
        env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{mib}m"
        env[f"CUDA_DEVICE_SM_LIMIT_{i}"] = exactly["capacity"]["requests"]["cores"]
    share, _ = read_share(env, parse_annotations(kubelet_annotations_file(pod)))
    assert (share.way, share.limit_for(0), share.limit_for(1), share.sm_limit) == (
        "hami-dra",
        40960 * MiB,
        40960 * MiB,
        "50",
    )


async def test_the_server_warns_when_the_cluster_gave_nothing_the_hub_asked_for(fake_api):
    pod = await build_pod(spawner_for(configured("hami-dra", DRA_MAPPING, host=fake_api.host), "dave"))
    share, warning = read_share({}, parse_annotations(kubelet_annotations_file(pod)))
    assert share is None and "the hub asked HAMi-DRA for gpu_memory 10240Mi" in warning


def test_the_template_schema_is_the_v1_api_of_kubernetes_1_34_and_later():
    """What the docs say: the DRA ways need resource.k8s.io/v1, which 1.33 does not serve."""
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": "x"},
                "spec": {"spec": {}},
            },
            "1.33",
            strict=True,
        )
    assert DRA_VERSIONS[0] == "1.34"


def test_the_record_is_json_the_reader_takes():
    from gpu_quota_ext.devices.downward import pod_record

    assert pod_record({"gpu-quota-ext/pod-gpu": json.dumps({"way": "kai", "gpus": 1})}) == {"way": "kai", "gpus": 1}
    assert pod_record({"gpu-quota-ext/pod-gpu": "{not json"}) is None
