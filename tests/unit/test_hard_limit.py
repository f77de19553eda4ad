"""The hard limit (MPS) of a kernel, and why a kernel gets none: pure, no server, no daemon."""

import json

import pytest

from gpu_quota_ext.devices import Device
from gpu_quota_ext.hard_limit import HardLimitSettings, build_hard_limit_settings
from gpu_quota_ext.hard_limit.decisions import (
    DEFAULT_CONTEXT_ALLOWANCE,
    Probe,
    Route,
    ceiling_commands,
    ceilings,
    decide,
    device_limits,
    hard_limit_bytes,
    kernel_ordinals,
    limit_variable,
    parse_limit_variable,
    probe_problem,
)
from gpu_quota_ext.launch_env import launch_env
from gpu_quota_ext.ledger import Grant
from gpu_quota_ext.policy import build_policy
from gpu_quota_ext.shared.sizes import GiB, MiB, PolicyError

TOTAL = 140 * GiB
DEVICES = {
    0: Device(0, "H200", "GPU-aaaa", TOTAL, 0),
    1: Device(1, "H200", "GPU-bbbb", TOTAL, 1),
    2: Device(2, "H200", "GPU-cccc", TOTAL, 2),
}
ON = HardLimitSettings(mode="auto")
ROUTE = Route("/run/mps/pipe", "/run/mps/log", "/run/mps/none")
ANSWERED = Probe(True, servers=())
UID = 1000


def grant(devices=(1,), cap=35 * GiB, max_cap=70 * GiB, placed=True):
    caps = {d: cap for d in devices}
    return Grant(
        "kid", "u", "python3", tuple(devices), caps, dict(caps), {d: max_cap for d in devices}, "default", placed
    )


# --- settings ------------------------------------------------------------------------------------------


def test_settings_default_to_off_and_parse_every_form():
    assert build_hard_limit_settings().mode == "off"
    settings = build_hard_limit_settings("MPS", "external", "cap", "1GiB", "/opt/nvidia/nvidia-cuda-mps-control", "2.5")
    assert (settings.mode, settings.daemon, settings.limit) == ("mps", "external", "cap")
    assert (settings.context_allowance, settings.timeout) == (GiB, 2.5)
    assert build_hard_limit_settings(mps_context_allowance="0").context_allowance == 0
    assert build_hard_limit_settings(mps_context_allowance="640MiB").context_allowance == DEFAULT_CONTEXT_ALLOWANCE


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"hard_cap": "yes"}, "c.GpuQuota.hard_cap = 'yes'"),
        ({"hard_cap": None}, "c.GpuQuota.hard_cap = None"),
        ({"mps_daemon": "system"}, "c.GpuQuota.mps_daemon = 'system'"),
        ({"hard_limit": "budget"}, "c.GpuQuota.hard_limit = 'budget'"),
        ({"mps_context_allowance": "0.1"}, "c.GpuQuota.mps_context_allowance = '0.1'"),
        ({"mps_context_allowance": "1TiB"}, "c.GpuQuota.mps_context_allowance = '1TiB'"),
        ({"mps_context_allowance": "lots"}, "c.GpuQuota.mps_context_allowance = 'lots'"),
        ({"mps_control": ""}, "c.GpuQuota.mps_control = ''"),
        ({"mps_timeout": "0"}, "c.GpuQuota.mps_timeout = '0'"),
        ({"mps_timeout": "nan"}, "c.GpuQuota.mps_timeout = 'nan'"),
        ({"mps_timeout": True}, "c.GpuQuota.mps_timeout = True"),
    ],
)
def test_bad_settings_name_the_setting_and_value(kwargs, named):
    with pytest.raises(PolicyError) as error:
        build_hard_limit_settings(**kwargs)
    assert str(error.value).startswith(named)


# --- the number ----------------------------------------------------------------------------------------


def test_limit_is_the_number_plus_the_context_in_whole_mib_never_above_the_device():
    assert hard_limit_bytes(10 * GiB, TOTAL, 640 * MiB) == 10 * GiB + 640 * MiB
    assert hard_limit_bytes(10 * GiB + 123, TOTAL, 640 * MiB) == 10 * GiB + 640 * MiB  # rounded down
    assert hard_limit_bytes(TOTAL, TOTAL, 640 * MiB) == TOTAL  # max_cap 1.0: the whole device, no more
    assert hard_limit_bytes(TOTAL + 5, TOTAL + 5, 0) == TOTAL  # a device size that is not whole MiB


def test_max_cap_is_the_default_number_and_cap_the_other():
    limits = device_limits(grant(), DEVICES, {}, ON)
    assert [(d.index, d.ordinal, d.limit, d.usable) for d in limits] == [(1, 0, 70 * GiB + 640 * MiB, 70 * GiB)]
    assert limit_variable(limits) == f"0={70 * 1024 + 640}M"
    by_cap = device_limits(grant(), DEVICES, {}, HardLimitSettings(mode="auto", limit="cap"))
    assert [(d.limit, d.usable) for d in by_cap] == [(35 * GiB + 640 * MiB, 35 * GiB)]


def test_ordinals_are_what_the_kernel_sees_on_several_devices():
    # Placed on server devices 0 and 2: CUDA_VISIBLE_DEVICES lists them in that order, so ordinals 0 and 1.
    placed = grant(devices=(0, 2))
    assert kernel_ordinals(placed, DEVICES, {"CUDA_VISIBLE_DEVICES": "anything the server had"}) == {0: 0, 2: 1}
    assert limit_variable(device_limits(placed, DEVICES, {}, ON)) == "0=72320M,1=72320M"
    # Unplaced (placement "none"): the kernel sees what its own CUDA_VISIBLE_DEVICES keeps, UUIDs included.
    unplaced = grant(devices=(0, 1, 2), placed=False)
    assert kernel_ordinals(unplaced, DEVICES, {}) == {0: 0, 1: 1, 2: 2}
    assert kernel_ordinals(unplaced, DEVICES, {"CUDA_VISIBLE_DEVICES": "GPU-cccc,0"}) == {2: 0, 0: 1}
    hidden = device_limits(unplaced, DEVICES, {"CUDA_VISIBLE_DEVICES": "GPU-cccc,0"}, ON)
    assert [(d.index, d.ordinal) for d in hidden] == [(2, 0), (0, 1)]  # device 1 is not visible: no entry


def test_a_tighter_limit_already_in_the_environment_wins():
    env = {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8G"}
    (limit,) = device_limits(grant(), DEVICES, env, ON)
    assert (limit.limit, limit.usable) == (8 * GiB, 8 * GiB - 640 * MiB)
    looser = device_limits(grant(), DEVICES, {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=500G"}, ON)
    assert looser[0].limit == 70 * GiB + 640 * MiB


def test_parse_limit_variable_reads_units_and_skips_what_it_cannot_read():
    assert parse_limit_variable("0=10G, 1=512MiB,2=1t,x=3G,3=7,4=5Q,") == {0: 10 * GiB, 1: 512 * MiB, 2: 1 << 40}
    assert parse_limit_variable(None) == {}


# --- uid and daemon ------------------------------------------------------------------------------------


def test_probe_problem_names_the_other_user_and_the_silence():
    assert probe_problem(Probe(True, servers=((41, UID),)), UID) is None
    assert probe_problem(ANSWERED, UID) is None
    other = probe_problem(Probe(True, servers=((41, UID), (42, 0))), UID)
    assert "another Unix user (uid 0, PID 42)" in other and "wait at its first CUDA call" in other
    assert "cannot read" in probe_problem(Probe(True, servers=((43, None),)), UID)
    assert "did not answer: timed out" in probe_problem(Probe(False, "timed out"), UID)


# --- the decision ----------------------------------------------------------------------------------------


def test_off_adds_nothing():
    layers, variables = decide(grant(), DEVICES, {}, HardLimitSettings(), None, None, UID, ROUTE)
    assert variables == {}
    assert not layers.hard and layers.soft and "off" in layers.reason
    assert "parkable" not in layers.to_json()  # the kernel's park object answers that, once


def test_a_usable_daemon_gives_limit_pipe_and_log_directories():
    layers, variables = decide(grant(devices=(0, 2)), DEVICES, {}, ON, None, ANSWERED, UID, ROUTE)
    assert variables["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=72320M,1=72320M"
    assert variables["CUDA_MPS_PIPE_DIRECTORY"] == "/run/mps/pipe"
    assert variables["CUDA_MPS_LOG_DIRECTORY"] == "/run/mps/log"
    seen = json.loads(variables["GPU_QUOTA_LAYERS"])
    assert seen["hard"] == "mps" and seen["reason"] is None
    assert [(d["ordinal"], d["index"], d["usable"]) for d in seen["devices"]] == [(0, 0, 70 * GiB), (1, 2, 70 * GiB)]
    view = layers.to_json(grant(devices=(0, 2)))
    assert view["hard_limit"] == {"mps": {"0": 72320 * MiB, "2": 72320 * MiB}}
    assert view["hard_reason"] is None and layers.hard  # the parker reads .hard: an MPS client is not parkable
    # An external daemon has no log directory of ours.
    _, external = decide(grant(), DEVICES, {}, ON, None, ANSWERED, UID, Route("/tmp/nvidia-mps"))
    assert external["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps" and "CUDA_MPS_LOG_DIRECTORY" not in external


@pytest.mark.parametrize(
    "unavailable, probe, words",
    [
        ("nvidia-cuda-mps-control was not found", ANSWERED, "was not found"),
        (None, Probe(False, "did not answer within 5 s"), "within 5 s"),
        (None, Probe(True, servers=((42, 0),)), "another Unix user (uid 0"),
    ],
)
def test_without_a_usable_daemon_the_kernel_is_kept_out_of_mps_and_told_why(unavailable, probe, words):
    layers, variables = decide(grant(), DEVICES, {}, ON, unavailable, probe, UID, ROUTE)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in variables
    # Routed to an empty directory: CUDA finds no daemon there and runs without MPS, never waits.
    assert variables["CUDA_MPS_PIPE_DIRECTORY"] == "/run/mps/none"
    assert words in layers.reason and words in json.loads(variables["GPU_QUOTA_LAYERS"])["reason"]
    assert layers.to_json()["hard_limit"] is None and not layers.hard


def test_a_cpu_only_kernel_has_no_layer_and_no_mps_variable():
    cpu = Grant("kid", "u", "python3", (), {}, {}, {}, "default", True, "budget full")
    layers, variables = decide(cpu, DEVICES, {}, ON, None, ANSWERED, UID, ROUTE)
    assert not layers.soft and "holds no GPU" in layers.reason
    assert set(variables) == {"GPU_QUOTA_LAYERS"}


def test_restart_needed_when_a_cap_is_raised_above_a_cap_sized_limit():
    settings = HardLimitSettings(mode="auto", limit="cap")
    layers, _ = decide(grant(cap=10 * GiB), DEVICES, {}, settings, None, ANSWERED, UID, ROUTE)
    assert layers.to_json(grant(cap=10 * GiB))["restart_needed"] is False
    assert layers.to_json(grant(cap=20 * GiB))["restart_needed"] is True


def test_launch_env_adds_the_hard_layer_last():
    _, variables = decide(grant(), DEVICES, {}, ON, None, ANSWERED, UID, ROUTE)
    env = launch_env(grant(), DEVICES, {}, hard_limit=variables)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == variables["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb"  # ordinal 0 in the limit is that device
    assert "CUDA_MPS_PIPE_DIRECTORY" not in launch_env(grant(), DEVICES, {})


def test_a_managed_daemon_gets_the_largest_limit_policy_can_give_as_its_default():
    devices = [Device(0, "H200", "GPU-a", 80 * GiB, 0), Device(1, "H200", "GPU-b", 80 * GiB, 3)]
    policy = build_policy("0.25", "0.5")
    found = ceilings(policy, devices, 640 * MiB)
    assert found == {0: 40 * GiB + 640 * MiB, 3: 40 * GiB + 640 * MiB}  # keyed by NVML index: the daemon's numbers
    assert ceiling_commands(found) == (
        "set_default_device_pinned_mem_limit 0 41600M\nset_default_device_pinned_mem_limit 3 41600M\n"
    )
    # A rule that lets some kernels go higher raises the ceiling; the whole device means no ceiling at all.
    ruled = build_policy("0.25", "0.5", [{"kernelspec": "big", "cap": "0.5", "max_cap": "60GiB"}])
    assert ceilings(ruled, devices[:1], 640 * MiB) == {0: 60 * GiB + 640 * MiB}
    assert ceilings(build_policy("0.25", "1.0"), devices, 640 * MiB) == {}
    assert ceilings(build_policy("0.25", "0.5", lambda user, spec: None), devices, 640 * MiB) == {}
    assert ceiling_commands({}) == ""


def test_settings_describe_names_the_setting_and_leaves_out_the_control_program():
    shown = HardLimitSettings(
        mode="mps", daemon="external", limit="cap", context_allowance=MiB, control="/x/mps"
    ).describe()
    assert shown == {"mode": "mps", "daemon": "external", "hard_limit": "cap", "context_allowance": MiB, "timeout": 5.0}


def test_at_shutdown_the_kernels_go_before_the_daemon_they_are_clients_of():
    import asyncio

    from gpu_quota_ext.hard_limit import HardLimitLayer

    done = []

    class Daemon:
        def stop(self):
            done.append("daemon")

    async def shutdown_kernels():
        done.append("kernels")

    layer = HardLimitLayer(HardLimitSettings())
    layer.daemon = Daemon()
    asyncio.run(layer.stop(shutdown_kernels))
    assert done == ["kernels", "daemon"] and layer.daemon is None
    asyncio.run(layer.stop(shutdown_kernels))  # no daemon of its own (off, or an external one): kernels untouched
    assert done == ["kernels", "daemon"]
