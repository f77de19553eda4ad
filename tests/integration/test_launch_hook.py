"""Issue 2: every kernel started through the server gets its cap at launch (real server, real kernels)."""

import asyncio
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tornado.httpclient import HTTPClientError
from traitlets.config import Config

from gpu_quota_ext.manager import SETTINGS_KEY
from gpu_quota_ext.shared import env_vars
from gpu_quota_ext.shared.env_vars import KERNEL_SIDE
from gpu_quota_ext.shared.sizes import GiB

from .kernels import (
    execute,
    kernel_env,
    restart_kernel,
    shutdown_kernel,
    start_kernel,
    static_devices_config,
    write_kernelspec,
)

CAP_VARIABLES = [
    "CUDA_VISIBLE_DEVICES",
    "CUPY_GPU_MEMORY_LIMIT",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "TF_FORCE_GPU_ALLOW_GROWTH",
    "PYTORCH_CUDA_ALLOC_CONF",
    "GPU_QUOTA_DEVICES",
    "GPU_QUOTA_KERNEL_ID",
    "GPU_QUOTA_KERNEL_TOKEN",
    "PYTHONSTARTUP",
]


@pytest.fixture
def jp_server_config():
    return Config(static_devices_config("80GiB", "80GiB", default_cap="0.25", max_cap="0.5"))


async def grants(jp_fetch) -> dict:
    status = json.loads((await jp_fetch("api", "gpu-quota", "status")).body)
    return {k["id"]: k for k in status["kernels"]}


async def test_kernel_environment_carries_the_cap_and_placement_spreads(jp_fetch, jp_serverapp):
    first = await start_kernel(jp_fetch)
    second = await start_kernel(jp_fetch)
    env1 = await kernel_env(jp_serverapp, first, CAP_VARIABLES)
    env2 = await kernel_env(jp_serverapp, second, CAP_VARIABLES)

    assert {env1["CUDA_VISIBLE_DEVICES"], env2["CUDA_VISIBLE_DEVICES"]} == {"0", "1"}  # one per GPU
    for kernel_id, env in ((first, env1), (second, env2)):
        assert env["GPU_QUOTA_KERNEL_ID"] == kernel_id
        assert env["CUPY_GPU_MEMORY_LIMIT"] == str(20 * GiB)
        assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.2500" and env["XLA_CLIENT_MEM_FRACTION"] is None
        assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # JAX grows to its cap, never takes it whole
        assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
        # torch 2.13 reads the fraction from the allocator config: the bootstrap wrote it.
        assert env["PYTORCH_CUDA_ALLOC_CONF"] == "per_process_memory_fraction:0.250000"
        (device,) = json.loads(env["GPU_QUOTA_DEVICES"])
        assert (device["ordinal"], device["cap"], device["max_cap"]) == (0, 20 * GiB, 40 * GiB)
        # The bootstrap hands PYTHONSTARTUP back (unset: the user had none), so child Pythons skip ours.
        assert env["PYTHONSTARTUP"] is None
        # The secret left the environment (children, `!env`, printed os.environ never show it).
        assert env["GPU_QUOTA_KERNEL_TOKEN"] is None

    recorded = await grants(jp_fetch)
    assert recorded[first]["devices"][0]["cap"] == 20 * GiB
    assert sorted(k["devices"][0]["index"] for k in recorded.values()) == [0, 1]


@pytest.mark.slow
async def test_torch_is_not_imported_and_is_capped_when_it_is(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    out = await execute(
        jp_serverapp,
        kernel_id,
        "import sys\n"
        "print('torch' in sys.modules)\n"
        "from gpu_quota_ext.kernel.state import STATE\n"
        "print(STATE.torch_route)\n"
        "import torch\n"
        "print(torch.cuda.is_initialized(), len(torch.cuda._queued_calls) >= 1)\n",
    )
    before, route, after = out.strip().splitlines()
    assert before == "False"
    assert "PYTORCH_CUDA_ALLOC_CONF" in route and "first CUDA use" in route
    assert after == "False True"  # CUDA untouched (no context); the exact cap waits for its first use


async def test_child_processes_inherit_the_torch_cap(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    out = await execute(
        jp_serverapp,
        kernel_id,
        "import subprocess, sys\n"
        "print(subprocess.run([sys.executable, '-c', "
        "'import os; print(os.environ[\"PYTORCH_CUDA_ALLOC_CONF\"], os.environ[\"CUPY_GPU_MEMORY_LIMIT\"])'],"
        " capture_output=True, text=True).stdout)",
    )
    assert out.split() == ["per_process_memory_fraction:0.250000", str(20 * GiB)]


async def test_restart_keeps_the_grant_and_shutdown_releases_it(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    await jp_fetch("api", "gpu-quota", "kernels", kernel_id, method="PUT", body=json.dumps({"cap": "0.4"}))
    before = (await grants(jp_fetch))[kernel_id]
    await restart_kernel(jp_fetch, kernel_id)
    after = (await grants(jp_fetch))[kernel_id]
    assert after["devices"] == before["devices"] and after["devices"][0]["cap"] == int(0.4 * 80 * GiB)
    env = await kernel_env(jp_serverapp, kernel_id, CAP_VARIABLES)
    assert json.loads(env["GPU_QUOTA_DEVICES"])[0]["cap"] == int(0.4 * 80 * GiB)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "per_process_memory_fraction:0.400000"

    await shutdown_kernel(jp_fetch, kernel_id)
    assert kernel_id not in await grants(jp_fetch)
    status = json.loads((await jp_fetch("api", "gpu-quota", "status")).body)
    assert sum(d["granted"] for d in status["devices"]) == 0


async def test_each_grant_is_one_info_line_in_the_log(jp_fetch, jp_serverapp, caplog):
    caplog.set_level(logging.INFO, logger="gpu_quota_ext")
    kernel_id = await start_kernel(jp_fetch)
    await restart_kernel(jp_fetch, kernel_id)  # keeps its grant: no second line
    lines = [r for r in caplog.records if r.name == "gpu_quota_ext" and kernel_id in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert lines[0].getMessage() == (
        f"gpu-quota-ext: kernel {kernel_id} (python3) granted 20.0 GiB on device 0 (max 40.0 GiB; source: default)"
    )


async def test_user_pythonstartup_still_runs(jp_fetch, jp_serverapp, tmp_path, monkeypatch):
    startup = tmp_path / "startup.py"
    startup.write_text("FROM_MY_STARTUP = 42\n")
    monkeypatch.setenv("PYTHONSTARTUP", str(startup))
    kernel_id = await start_kernel(jp_fetch)
    out = await execute(jp_serverapp, kernel_id, "import os; print(FROM_MY_STARTUP, os.environ['PYTHONSTARTUP'])")
    assert out.split() == ["42", str(startup)]


@pytest.fixture
def tiny_kernelspec(jp_kernel_dir):
    script = Path(__file__).with_name("tiny_kernel.py")
    spec = {
        "argv": ["/bin/sh", "-c", 'exec "$0" "$1" -f "$2"', sys.executable, str(script), "{connection_file}"],
        "display_name": "Tiny (not Python)",
        "language": "text",
        "env": {"TINY_OWN": "kept"},
    }
    return write_kernelspec(jp_kernel_dir, "tiny", spec)


async def test_a_non_python_kernel_gets_the_environment_and_starts(jp_fetch, jp_serverapp, tiny_kernelspec):
    kernel_id = await start_kernel(jp_fetch, tiny_kernelspec)
    out = await execute(jp_serverapp, kernel_id, "CUPY_GPU_MEMORY_LIMIT GPU_QUOTA_KERNEL_ID PYTHONSTARTUP TINY_OWN")
    assert out.split() == [
        f"CUPY_GPU_MEMORY_LIMIT={20 * GiB}",
        f"GPU_QUOTA_KERNEL_ID={kernel_id}",
        "PYTHONSTARTUP=None",
        "TINY_OWN=kept",
    ]


async def test_a_non_python_kernel_never_holds_the_kernel_secret(jp_fetch, jp_serverapp, tiny_kernelspec):
    # Issue 10, item 9: no bootstrap removes the secret from a non-Python kernel's environment, where
    # every child process and printed environment would show it; it cannot use %gpucap anyway.
    kernel_id = await start_kernel(jp_fetch, tiny_kernelspec)
    out = await execute(jp_serverapp, kernel_id, "GPU_QUOTA_KERNEL_TOKEN GPU_QUOTA_API_URL CUPY_GPU_MEMORY_LIMIT")
    assert out.split() == ["GPU_QUOTA_KERNEL_TOKEN=None", "GPU_QUOTA_API_URL=None", f"CUPY_GPU_MEMORY_LIMIT={20 * GiB}"]
    # No secret was made for it either: nothing can act as this kernel through the API.
    assert kernel_id not in jp_serverapp.web_app.settings[SETTINGS_KEY]._tokens


async def test_kernel_side_variables_of_the_servers_environment_never_reach_a_kernel(
    jp_fetch, jp_serverapp, tiny_kernelspec, monkeypatch
):
    """Issue 19: GPU_QUOTA_LAYERS='{' or a CPU-only reason with escape sequences in the server's own
    environment reached capped kernels (the hard layer was off, the kernel not CPU-only: nothing replaced them)."""
    planted = {name: "\x1b]0;owned\x07{" for name in KERNEL_SIDE}
    for name, value in planted.items():
        monkeypatch.setenv(name, value)
    python = await start_kernel(jp_fetch)
    seen = await kernel_env(jp_serverapp, python, KERNEL_SIDE)
    assert seen[env_vars.LAYERS] is None and seen[env_vars.CPU_ONLY_REASON] is None and seen[env_vars.TOKEN] is None
    assert seen[env_vars.KERNEL_ID] == python and json.loads(seen[env_vars.DEVICES])[0]["cap"] == 20 * GiB
    assert not [name for name, value in seen.items() if value == planted[name]], seen
    other = await start_kernel(jp_fetch, tiny_kernelspec)
    out = (await execute(jp_serverapp, other, " ".join(KERNEL_SIDE))).split()
    assert not [entry for entry in out if "owned" in entry], out
    assert f"{env_vars.API_URL}=None" in out and f"{env_vars.TOKEN}=None" in out
    for kernel_id in (python, other):
        await shutdown_kernel(jp_fetch, kernel_id)


@pytest.fixture
def bash_kernelspec(jp_kernel_dir, tmp_path):
    """The real bash_kernel (PyPI), its kernelspec installed by its own installer into a temp prefix."""
    subprocess.run([sys.executable, "-m", "bash_kernel.install", "--prefix", str(tmp_path)], check=True,
                   capture_output=True)
    installed = tmp_path / "share" / "jupyter" / "kernels" / "bash"
    spec = json.loads((installed / "kernel.json").read_text())
    assert Path(spec["argv"][0]).name.startswith("python") and spec["language"] == "bash"  # what the test is about
    shutil.copytree(installed, Path(jp_kernel_dir) / "bash")
    return "bash"


async def test_bash_kernel_gets_its_caps_but_no_secret_and_no_bootstrap(jp_fetch, jp_serverapp, bash_kernelspec):
    """Issue 19: bash_kernel's argv[0] is a python, so it got the secret and PYTHONSTARTUP, and kept the secret
    in its environment, where every child process sees it. The kernelspec's language decides."""
    kernel_id = await start_kernel(jp_fetch, bash_kernelspec)
    out = await execute(
        jp_serverapp,
        kernel_id,
        'echo "token=${GPU_QUOTA_KERNEL_TOKEN-unset} url=${GPU_QUOTA_API_URL-unset} startup=${PYTHONSTARTUP-unset}"\n'
        "sh -c 'echo child=${GPU_QUOTA_KERNEL_TOKEN-unset}'\n"
        'echo "cupy=$CUPY_GPU_MEMORY_LIMIT id=$GPU_QUOTA_KERNEL_ID"',
    )
    assert out.split() == [
        "token=unset", "url=unset", "startup=unset", "child=unset", f"cupy={20 * GiB}", f"id={kernel_id}",
    ], out
    assert kernel_id not in jp_serverapp.web_app.settings[SETTINGS_KEY]._tokens
    await shutdown_kernel(jp_fetch, kernel_id)


@pytest.mark.slow
class TestConcurrentStarts:
    @pytest.fixture
    def jp_server_config(self):
        # 2 x 80 GiB, budget 1.0 x device, 20 GiB caps: room for exactly 8 kernels.
        return Config(static_devices_config("80GiB", "80GiB", default_cap="0.25", overcommit=1.0, on_full="cpu-only"))

    async def test_twenty_concurrent_starts_never_overcommit(self, jp_fetch, jp_serverapp):
        ids = await asyncio.gather(*(start_kernel(jp_fetch) for _ in range(20)))
        status = json.loads((await jp_fetch("api", "gpu-quota", "status")).body)
        assert len(status["kernels"]) == 20
        on_gpu = [k for k in status["kernels"] if k["devices"]]
        assert len(on_gpu) == 8
        assert all(d["granted"] <= d["budget"] for d in status["devices"])
        assert [d["granted"] for d in status["devices"]] == [80 * GiB, 80 * GiB]
        cpu_only = next(k for k in status["kernels"] if not k["devices"])
        env = await kernel_env(jp_serverapp, cpu_only["id"], ["CUDA_VISIBLE_DEVICES", "GPU_QUOTA_CPU_ONLY_REASON"])
        assert env["CUDA_VISIBLE_DEVICES"] == "" and "budget" in env["GPU_QUOTA_CPU_ONLY_REASON"]
        assert set(ids) == {k["id"] for k in status["kernels"]}


class TestRefuseWhenFull:
    @pytest.fixture
    def jp_server_config(self):
        settings = dict(default_cap="0.5", max_cap="0.5", overcommit=1.0, on_full="refuse")
        return Config(static_devices_config("80GiB", **settings))

    async def test_a_full_gpu_refuses_the_start_with_a_reason(self, jp_fetch, jp_serverapp):
        await start_kernel(jp_fetch)
        await start_kernel(jp_fetch)
        with pytest.raises(HTTPClientError) as refused:
            await start_kernel(jp_fetch)
        assert refused.value.code == 503
        assert "no GPU has 0.5 of budget left" in refused.value.response.body.decode()
        kernels = json.loads((await jp_fetch("api", "kernels")).body)
        assert len(kernels) == 2  # the refused one left nothing behind
        status = json.loads((await jp_fetch("api", "gpu-quota", "status")).body)
        assert len(status["kernels"]) == 2


class TestNoGpu:
    @pytest.fixture
    def jp_server_config(self):
        return Config(static_devices_config())

    async def test_a_server_without_gpus_starts_kernels_normally(self, jp_fetch, jp_serverapp):
        kernel_id = await start_kernel(jp_fetch)
        env = await kernel_env(jp_serverapp, kernel_id, CAP_VARIABLES)
        assert env["GPU_QUOTA_KERNEL_ID"] == kernel_id
        assert env["CUDA_VISIBLE_DEVICES"] is None and env["GPU_QUOTA_DEVICES"] is None
        status = json.loads((await jp_fetch("api", "gpu-quota", "status")).body)
        assert status["gpu"] is False and "no GPU" in status["message"]


@pytest.fixture
def pinned_kernelspec(jp_kernel_dir):
    """A kernelspec whose admin pinned it to the second GPU through its own env."""
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python (GPU 1 only)",
        "language": "python",
        "env": {"CUDA_VISIBLE_DEVICES": "1"},
    }
    return write_kernelspec(jp_kernel_dir, "pinned", spec)


async def test_a_kernelspec_pinned_to_a_gpu_is_placed_only_there(jp_fetch, jp_serverapp, pinned_kernelspec):
    # Spread alone would put the first kernel on GPU 0; the kernelspec's own choice wins.
    kernel_id = await start_kernel(jp_fetch, pinned_kernelspec)
    env = await kernel_env(jp_serverapp, kernel_id, ["CUDA_VISIBLE_DEVICES", "GPU_QUOTA_DEVICES"])
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert json.loads(env["GPU_QUOTA_DEVICES"])[0]["index"] == 1
    assert (await grants(jp_fetch))[kernel_id]["devices"][0]["index"] == 1
