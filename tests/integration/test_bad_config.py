"""Invalid settings stop a real server at start with one line naming the setting and the value."""

import json
import os
import subprocess

import pytest

from .servers import server_command

pytestmark = pytest.mark.slow  # each test starts a whole server or a CLI process

STATIC = ["--GpuQuota.inventory_class=gpu_quota_ext.devices.StaticInventory"]


def start_server(tmp_path, args, env_extra=None, config=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_QUOTA_")}
    env.update(
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), **(env_extra or {})
    )
    if config is not None:
        (tmp_path / "config").mkdir(exist_ok=True)
        (tmp_path / "config" / "jupyter_server_config.json").write_text(json.dumps(config))
    command = server_command(tmp_path, *args)
    # Read the log until the server exits or says it is serving; (None, log) means it is serving.
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in process.stderr:
            lines.append(line)
            if "is running at" in line:
                return None, "".join(lines)
        return process.wait(timeout=30), "".join(lines)
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    "args, env_extra, config, expected",
    [
        (["--GpuQuota.default_cap=abc"], None, None, "c.GpuQuota.default_cap = 'abc'"),
        (["--GpuQuota.max_cap=150%"], None, None, "c.GpuQuota.max_cap = '150%'"),
        (["--GpuQuota.placement=random"], None, None, "c.GpuQuota.placement = 'random'"),
        ([], {"GPU_QUOTA_OVERCOMMIT": "lots"}, None, "c.GpuQuota.overcommit = 'lots'"),
        ([], {"GPU_QUOTA_ON_FULL": "wait"}, None, "c.GpuQuota.on_full = 'wait'"),
        ([], None, {"GpuQuota": {"caps": [{"user": "alice", "cap": "2.0"}]}}, "c.GpuQuota.caps"),
        ([], None, {"StaticInventory": {"devices": [{"total": "half"}]}}, "c.StaticInventory.devices[0]['total']"),
        (["--GpuQuota.inventory_class=os.path"], None, None, "inventory_class"),
        # Typed traits: a choice, a range, a type; from the command line, the environment and a config file.
        (["--GpuQuota.hard_cap=yes"], None, None, "c.GpuQuota.hard_cap = 'yes': must be one of 'off', 'auto', 'mps'"),
        (
            [],
            {"GPU_QUOTA_ENFORCE": "explode"},
            None,
            "c.GpuQuota.enforce = 'explode' (from the environment variable GPU_QUOTA_ENFORCE): must be one of",
        ),
        (
            ["--GpuQuota.grace=soon"],
            None,
            None,
            "c.GpuQuota.grace = 'soon': must be a number of seconds from 0 to 3600",
        ),
        ([], {"GPU_QUOTA_MPS_TIMEOUT": "0"}, None, "(from the environment variable GPU_QUOTA_MPS_TIMEOUT)"),
        ([], None, {"GpuQuota": {"caps": "alice"}}, "c.GpuQuota.caps = 'alice': must be a list of rules or a callable"),
    ],
)
def test_invalid_setting_stops_the_server_with_one_clear_line(tmp_path, args, env_extra, config, expected):
    returncode, stderr = start_server(
        tmp_path, STATIC + args if "inventory_class" not in str(args) else args, env_extra, config
    )
    assert returncode not in (None, 0), "the server kept running with an invalid setting"
    ours = [line for line in stderr.splitlines() if "gpu-quota-ext: invalid configuration" in line]
    assert len(ours) == 1, stderr
    assert expected in ours[0]
    assert "Traceback" not in stderr


def test_valid_settings_start_the_server(tmp_path):
    returncode, stderr = start_server(tmp_path, STATIC + ["--GpuQuota.default_cap=12GiB", "--GpuQuota.placement=pack"])
    assert returncode is None, stderr  # still serving when the timeout hit
    assert "gpu-quota-ext: default_cap 12GiB" in stderr


def test_numbers_in_a_config_file_start_the_server(tmp_path):
    config = {"GpuQuota": {"default_cap": 0.5, "max_cap": 1, "slack": 2**30, "grace": 2, "overcommit": 1.5}}
    returncode, stderr = start_server(tmp_path, STATIC, config=config)
    assert returncode is None, stderr
    assert "gpu-quota-ext: default_cap 0.5, max_cap 1, placement spread, on_full cpu-only, overcommit 1.5" in stderr
    assert "gpu-quota-ext: watchdog enforce warn, slack 1073741824, grace 2.0s" in stderr
