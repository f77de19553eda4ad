"""Grant -> kernel environment: pure, no server."""

import json

from gpu_quota_ext.devices import Device
from gpu_quota_ext.launch_env import STARTUP_FILE, is_python_kernel, kernel_environment, launch_env
from gpu_quota_ext.ledger import Grant
from gpu_quota_ext.shared import env_vars
from gpu_quota_ext.shared.env_vars import KERNEL_SIDE
from gpu_quota_ext.shared.sizes import GiB

DEVICES = {0: Device(0, "H200", "GPU-aaaa", 140 * GiB, 0), 1: Device(1, "H200", "GPU-bbbb", 140 * GiB, 1)}


def grant(devices=(1,), cap=35 * GiB, placed=True, reason=None):
    caps = {d: cap for d in devices}
    return Grant(
        "kid",
        "u",
        "python3",
        tuple(devices),
        caps,
        dict(caps),
        {d: 70 * GiB for d in devices},
        "default",
        placed,
        reason,
    )


def test_placed_grant_sets_every_framework_and_our_variables():
    env = launch_env(grant(), DEVICES, {}, api_url="http://127.0.0.1:8888/", token="s3cret")
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb"
    assert env["CUPY_GPU_MEMORY_LIMIT"] == str(35 * GiB)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.2500"
    assert "XLA_CLIENT_MEM_FRACTION" not in env  # JAX 0.11 falls back to the CPU when both are set
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert env["GPU_QUOTA_KERNEL_ID"] == "kid"
    assert env["GPU_QUOTA_KERNEL_TOKEN"] == "s3cret"
    assert env["GPU_QUOTA_API_URL"] == "http://127.0.0.1:8888/"
    assert env["GPU_QUOTA_CAP_SOURCE"] == "default"
    assert json.loads(env["GPU_QUOTA_DEVICES"]) == [
        {"ordinal": 0, "index": 1, "uuid": "GPU-bbbb", "cap": 35 * GiB, "max_cap": 70 * GiB, "total": 140 * GiB}
    ]
    assert env["PYTHONSTARTUP"] == str(STARTUP_FILE)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env  # the bootstrap decides, knowing the kernel's torch


def test_user_limits_are_merged_never_loosened():
    tighter = {"CUPY_GPU_MEMORY_LIMIT": str(GiB), "XLA_PYTHON_CLIENT_MEM_FRACTION": ".1"}
    env = launch_env(grant(), DEVICES, tighter)
    assert env["CUPY_GPU_MEMORY_LIMIT"] == str(GiB)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == ".1"
    # The user chose JAX's newer name: we tighten theirs and do not add the older one.
    newer = launch_env(grant(), DEVICES, {"XLA_CLIENT_MEM_FRACTION": "0.9"})
    assert newer["XLA_CLIENT_MEM_FRACTION"] == "0.2500" and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in newer
    assert launch_env(grant(), DEVICES, {"TF_FORCE_GPU_ALLOW_GROWTH": "false"})["TF_FORCE_GPU_ALLOW_GROWTH"] == "false"


def test_jax_grows_to_its_cap_instead_of_taking_it_at_once():
    """Issue 31 item 11: with its fraction alone JAX preallocates the whole cap (a 4 GiB array held and parked
    28 GiB). Preallocation off, the fraction still bounds its pool; TF likewise grows (allow-growth)."""
    env = launch_env(grant(), DEVICES, {})
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.2500"  # the limit stays: growth is up to the cap
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    newer = launch_env(grant(), DEVICES, {"XLA_CLIENT_MEM_FRACTION": "0.9"})
    assert newer["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    # The kernelspec's (or the server environment's) own choice stands: preallocating never lifts the cap.
    chosen = launch_env(grant(), DEVICES, {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"})
    assert chosen["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true" and chosen["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.2500"
    # A kernel without a GPU gets no framework variable at all.
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in launch_env(grant(devices=(), placed=True, reason="full"), DEVICES, {})


def test_user_pythonstartup_is_chained():
    env = launch_env(grant(), DEVICES, {"PYTHONSTARTUP": "/home/u/.startup.py"})
    assert env["GPU_QUOTA_USER_PYTHONSTARTUP"] == "/home/u/.startup.py"
    assert env["PYTHONSTARTUP"] == str(STARTUP_FILE)
    # A restart merges our own value back in: it must not chain itself.
    again = launch_env(grant(), DEVICES, {"PYTHONSTARTUP": str(STARTUP_FILE)})
    assert "GPU_QUOTA_USER_PYTHONSTARTUP" not in again


def test_non_python_kernels_get_the_environment_only():
    env = launch_env(grant(), DEVICES, {}, python_kernel=False)
    assert "PYTHONSTARTUP" not in env and env["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb"


def test_non_python_kernels_never_get_the_secret():
    # Issue 10, item 9: only the Python bootstrap moves the secret out of the environment.
    env = launch_env(grant(), DEVICES, {}, api_url="http://127.0.0.1:8888/", token="s3cret", python_kernel=False)
    assert "GPU_QUOTA_KERNEL_TOKEN" not in env and "GPU_QUOTA_API_URL" not in env
    assert env["CUPY_GPU_MEMORY_LIMIT"] == str(35 * GiB) and env["GPU_QUOTA_KERNEL_ID"] == "kid"


def test_an_inherited_limit_that_is_not_positive_is_ignored():
    # Issue 10, item 3: CuPy reads 0 as "no limit"; JAX's 0 is no use either. Ours is written instead.
    for bad in ("0", "00", "-5", "abc", "", " ", "1e9"):
        env = launch_env(grant(), DEVICES, {"CUPY_GPU_MEMORY_LIMIT": bad, "XLA_PYTHON_CLIENT_MEM_FRACTION": bad})
        assert env["CUPY_GPU_MEMORY_LIMIT"] == str(35 * GiB), bad
        assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.2500", bad
    assert launch_env(grant(), DEVICES, {"CUPY_GPU_MEMORY_LIMIT": "1048576"})["CUPY_GPU_MEMORY_LIMIT"] == "1048576"


def test_the_smallest_cap_is_never_written_as_zero():
    one_mib = launch_env(grant(devices=(0,), cap=1 << 20), DEVICES, {})
    assert one_mib["CUPY_GPU_MEMORY_LIMIT"] == str(1 << 20)
    fraction = one_mib["XLA_PYTHON_CLIENT_MEM_FRACTION"]
    assert 0 < float(fraction) <= (1 << 20) / (140 * GiB) and fraction == "0.000006"


def test_cpu_only_grant_hides_the_gpus():
    env = launch_env(grant(devices=(), reason="full"), DEVICES, {})
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["GPU_QUOTA_CPU_ONLY_REASON"] == "full"
    assert "CUPY_GPU_MEMORY_LIMIT" not in env and "GPU_QUOTA_DEVICES" not in env


def test_unplaced_grant_keeps_visibility_and_fixes_the_order():
    env = launch_env(grant(devices=(0, 1), placed=False), DEVICES, {})
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert [d["ordinal"] for d in json.loads(env["GPU_QUOTA_DEVICES"])] == [0, 1]


def test_fraction_is_rounded_down_but_reads_as_written():
    cap = int(0.2 * 150_754_820_096)  # what the ledger grants for "0.2" on an H200
    env = launch_env(grant(devices=(0,), cap=cap), {0: Device(0, "H200", "GPU-a", 150_754_820_096, 0)}, {})
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.2000"
    env = launch_env(
        grant(devices=(0,), cap=int(0.33339 * 150_754_820_096)), {0: Device(0, "H200", "GPU-a", 150_754_820_096, 0)}, {}
    )
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.3333"


def test_is_python_kernel():
    assert is_python_kernel(["/usr/bin/python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"], "python")
    assert is_python_kernel(["python", "-m", "ipykernel"], "Python")
    assert is_python_kernel(["/opt/env/bin/kernel-wrapper", "-m", "ipykernel_launcher"], "python")
    assert not is_python_kernel(["R", "--slave", "-e", "IRkernel::main()"], "R")
    assert not is_python_kernel(["julia", "-i", "kernel.jl"], "julia")
    assert not is_python_kernel([], "python")
    # bash_kernel: a python runs it, but no bootstrap does (issue 19): the language decides.
    assert not is_python_kernel(["/usr/bin/python3", "-m", "bash_kernel", "-f", "{connection_file}"], "bash")
    assert not is_python_kernel(["/usr/bin/python3", "-m", "ipykernel_launcher"], None)


def test_every_kernel_side_variable_of_the_servers_environment_is_set_or_removed():
    """Issue 19: GPU_QUOTA_LAYERS='{' or a CPU-only reason with escape sequences in the server's own environment
    reached capped kernels."""
    server = {name: "\x1b[31m{" for name in KERNEL_SIDE}
    server.update(PATH="/usr/bin", CUPY_GPU_MEMORY_LIMIT="999")
    for python, secret in ((True, "s3cret"), (False, None)):
        variables = launch_env(grant(), DEVICES, server, token=secret, api_url="http://x/", python_kernel=python)
        kernel = kernel_environment(server, variables)
        assert {name: kernel.get(name) for name in KERNEL_SIDE} == {name: variables.get(name) for name in KERNEL_SIDE}
        assert kernel["PATH"] == "/usr/bin" and kernel["CUPY_GPU_MEMORY_LIMIT"] == "999"
        assert all("\x1b" not in value for name, value in kernel.items() if name in KERNEL_SIDE)
        assert env_vars.LAYERS not in kernel and env_vars.CPU_ONLY_REASON not in kernel
    cpu_only = kernel_environment(server, launch_env(grant(devices=(), reason="full"), DEVICES, server))
    assert cpu_only[env_vars.CPU_ONLY_REASON] == "full" and env_vars.DEVICES not in cpu_only


def test_a_server_inside_one_of_our_kernels_keeps_the_users_own_startup():
    inside = {"PYTHONSTARTUP": str(STARTUP_FILE), env_vars.USER_STARTUP: "/home/u/.startup.py"}
    assert launch_env(grant(), DEVICES, inside)[env_vars.USER_STARTUP] == "/home/u/.startup.py"
