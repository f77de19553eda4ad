"""Issue 10, item 3: no cap below 1 MiB enters anywhere, and no framework variable is ever written as 0.

CuPy reads CUPY_GPU_MEMORY_LIMIT=0 as "no limit": a cap of 0 bytes would be no cap at all. Real server,
real kernels, the REST API, the magic and the server's own environment.
"""

import json

import pytest
from traitlets.config import Config

from gpu_quota_ext.shared.sizes import GiB

from ..kernel_transport import short_directory
from .kernels import kernel_env, start_kernel, static_devices_config
from .servers import serving
from .test_bad_config import STATIC, start_server

DEVICE_TOTAL = 80 * GiB
POLICY_CAP = int(0.25 * DEVICE_TOTAL)


@pytest.fixture
def jp_server_config():
    return Config(static_devices_config("80GiB", default_cap="0.25", max_cap="0.5"))


async def caps(jp_fetch, kernel_id):
    record = json.loads((await jp_fetch("api", "gpu-quota", "kernels", kernel_id)).body)
    return [d["cap"] for d in record["devices"]]


@pytest.fixture(scope="module")
def shared(short_tmp):
    """One server and one kernel for the refusals below: each leaves the kernel's cap as it was, and checks it."""
    config = static_devices_config("80GiB", default_cap="0.25", max_cap="0.5")
    with serving(short_directory(short_tmp), config) as server:
        yield server, server.start_kernel()


def caps_of(server, kernel_id):
    return [d["cap"] for d in server.api(f"/api/gpu-quota/kernels/{kernel_id}")["devices"]]


@pytest.mark.parametrize(
    "cap, words",
    [
        (1e-320, "less than 1 MiB of any GPU"),
        ("0.00000000001", "less than 1 MiB of any GPU"),
        ("0.0000001", "of device 0 (80.0 GiB) is 8.4 KiB: a cap must be at least 1 MiB"),
        (1000, "at least 1 MiB"),
    ],
)
def test_the_api_refuses_a_cap_below_one_mib(shared, cap, words):
    server, kernel_id = shared
    status, answer = server.answer(f"/api/gpu-quota/kernels/{kernel_id}", "PUT", {"cap": cap})
    assert status == 400
    assert words in answer["message"]
    assert caps_of(server, kernel_id) == [POLICY_CAP]


@pytest.mark.parametrize(
    "line, said",
    [
        # Below 1 MiB of any GPU: the magic cannot read it as a cap, a usage error as IPython's own magics give.
        ("%gpucap 0.00000000001", ("error", "UsageError: ")),
        # 8.4 KiB of this kernel's 80 GiB device: the server refuses it, in one line.
        ("%gpucap 0.0000001", ("ok", "gpu-quota: error: ")),
    ],
)
def test_the_magic_refuses_a_cap_below_one_mib(shared, line, said):
    server, kernel_id = shared
    out = server.cell(kernel_id, line)
    status, start = said
    assert out.status == status and out.errors == [] and "Traceback" not in out.stderr
    (error,) = out.stderr.strip().splitlines()
    assert error.startswith(start) and "1 MiB" in error
    assert caps_of(server, kernel_id) == [POLICY_CAP]
    env = json.loads(
        server.run(kernel_id, "import os, json; print(json.dumps(os.environ.get('CUPY_GPU_MEMORY_LIMIT')))")
    )
    assert env == str(POLICY_CAP)


def test_a_huge_cap_is_echoed_short(shared):
    # Issue 10, item 8 (the part in policy.py): the answer quotes at most about 60 characters of the input.
    server, kernel_id = shared
    for cap in ["9" * 50_000 + "x", "0." + "0" * 50_000 + "1"]:
        status, answer = server.answer(f"/api/gpu-quota/kernels/{kernel_id}", "PUT", {"cap": cap})
        assert status == 400
        message = answer["message"]
        assert len(message) < 250 and "..." in message, message
    assert caps_of(server, kernel_id) == [POLICY_CAP]


@pytest.mark.parametrize("inherited", ["0", "-1", "garbage"])
async def test_an_inherited_limit_of_zero_is_not_passed_on(jp_fetch, jp_serverapp, monkeypatch, inherited):
    monkeypatch.setenv("CUPY_GPU_MEMORY_LIMIT", inherited)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", inherited)
    kernel_id = await start_kernel(jp_fetch)
    env = await kernel_env(jp_serverapp, kernel_id, ["CUPY_GPU_MEMORY_LIMIT", "XLA_PYTHON_CLIENT_MEM_FRACTION"])
    assert env == {"CUPY_GPU_MEMORY_LIMIT": str(POLICY_CAP), "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.2500"}


class TestCallableAnsweringZero:
    @pytest.fixture
    def jp_server_config(self):
        return Config(static_devices_config("80GiB", default_cap="0.25", caps=lambda user, kernelspec: 1e-320))

    async def test_a_callable_below_the_floor_gives_the_default_policy(self, jp_fetch, jp_serverapp, caplog):
        kernel_id = await start_kernel(jp_fetch)
        assert await caps(jp_fetch, kernel_id) == [POLICY_CAP]
        warnings = [
            r.getMessage()
            for r in caplog.records
            if r.name == "gpu_quota_ext" and r.levelname == "WARNING" and "caps callable" in r.getMessage()
        ]
        assert len(warnings) == 1 and "1 MiB" in warnings[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, config, expected",
    [
        (["--GpuQuota.default_cap=0.00000000001"], None, "c.GpuQuota.default_cap = '0.00000000001'"),
        ([], {"GpuQuota": {"caps": [{"user": "*", "cap": "0.000000001%"}]}}, "c.GpuQuota.caps"),
        (["--GpuQuota.max_cap=0.00000000001", "--GpuQuota.default_cap=1MiB"], None, "c.GpuQuota.max_cap"),
    ],
)
def test_a_config_cap_below_one_mib_stops_the_server(tmp_path, args, config, expected):
    returncode, stderr = start_server(tmp_path, STATIC + args, None, config)
    assert returncode not in (None, 0), "the server kept running with a cap below 1 MiB"
    ours = [line for line in stderr.splitlines() if "gpu-quota-ext: invalid configuration" in line]
    assert len(ours) == 1 and expected in ours[0] and "1 MiB" in ours[0], stderr
