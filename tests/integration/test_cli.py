"""`jupyter gpu-quota`, run as a user runs it: a subprocess, with its own config directory and environment.

--help-all lists every setting of the GpuQuota extension with its help; --generate-config writes a config
that loads and, uncommented, is valid and changes nothing; `check` reads the config files, the command
line and the environment the way the server does, and a bad configuration ends with the very line a real
server prints for it, naming the environment variable when the value came from one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpu_quota_ext
from gpu_quota_ext.app import GpuQuota

from .fake_mps import FAKE_CONTROL, fake_processes
from .test_bad_config import start_server

pytestmark = pytest.mark.slow  # each test starts a whole server or a CLI process

SETTINGS = sorted(GpuQuota.class_own_traits(config=True))
STATIC = "--GpuQuota.inventory_class=gpu_quota_ext.devices.StaticInventory"


def command() -> list:
    """The installed console script (`jupyter gpu-quota` runs it), next to this Python."""
    script = Path(sys.executable).with_name("jupyter-gpu-quota")
    assert script.exists(), "the package's console script is not installed (pip install -e .)"
    return [sys.executable, str(script)]


def environment(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_QUOTA_")}
    env.update(JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), **extra)
    return env


def gpu_quota(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*command(), *args], env=environment(tmp_path, **env), cwd=tmp_path, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("args", [["--version"], ["check", "--version"]])
def test_version_is_the_packages(tmp_path, args):
    # One source: gpu_quota_ext.__version__ (hatch writes it into the metadata; tests/package checks a wheel's).
    result = gpu_quota(tmp_path, *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == gpu_quota_ext.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", gpu_quota_ext.__version__) and gpu_quota_ext.__version__ != "0.0"


def test_help_all_lists_every_setting_with_its_help(tmp_path):
    result = gpu_quota(tmp_path, "--help-all")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for name in SETTINGS:
        assert f"--GpuQuota.{name}=" in out, name
        first_words = " ".join(GpuQuota.class_traits()[name].help.split()[:6])
        assert first_words in " ".join(out.split()), (name, first_words)
    assert "--StaticInventory.devices" in out
    assert "check" in out


def test_help_all_shows_the_value_the_environment_gives(tmp_path):
    out = gpu_quota(tmp_path, "--help-all", GPU_QUOTA_DEFAULT_CAP="0.1").stdout
    block = out.split("--GpuQuota.default_cap=", 1)[1].split("--GpuQuota.", 1)[0]
    assert "Current: '0.1'" in block, block


def test_generated_config_is_every_setting_commented_and_valid_when_uncommented(tmp_path):
    result = gpu_quota(tmp_path, "--generate-config", GPU_QUOTA_DEFAULT_CAP="0.1")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assigned = re.findall(r"^# c\.GpuQuota\.(\w+) = ", text, re.M)
    assert sorted(assigned) == SETTINGS
    assert "# c.GpuQuota.default_cap = '0.25'" in text  # the built-in default, not this shell's variable
    assert not re.search(r"^c\.GpuQuota", text, re.M)  # nothing set until the admin uncomments it
    uncommented = tmp_path / "all_settings.py"
    uncommented.write_text(re.sub(r"^# (c\.\w+\.\w+ = )", r"\1", text, flags=re.M))
    checked = gpu_quota(
        tmp_path, "check", f"--config={uncommented}", "--GpuQuota.inventory_class=gpu_quota_ext.devices.StaticInventory"
    )
    assert checked.returncode == 0, checked.stderr
    assert "configuration valid" in checked.stdout
    assert re.search(r"default_cap\s+0\.25\s+\(from config\)", checked.stdout), checked.stdout


def test_check_reads_the_servers_config_files_and_environment(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "jupyter_server_config.py").write_text(
        "c.GpuQuota.inventory_class = 'gpu_quota_ext.devices.StaticInventory'\n"
        "c.StaticInventory.devices = [{'name': 'Check GPU', 'total': '40GiB'}]\n"
        "c.GpuQuota.max_cap = '0.5'\n"
    )
    result = gpu_quota(
        tmp_path,
        "check",
        "--GpuQuota.placement=pack",
        GPU_QUOTA_DEFAULT_CAP="0.2",
        GPU_QUOTA_ENFORCE="kill",
        GPU_QUOTA_PARK_IDLE_AFTER="30min",
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert str(tmp_path / "config" / "jupyter_server_config.py") in out
    assert re.search(r"default_cap\s+0\.2\s+\(from \$GPU_QUOTA_DEFAULT_CAP\)", out), out
    assert re.search(r"max_cap\s+0\.5\s+\(from config\)", out), out
    assert re.search(r"placement\s+pack\s+\(from config\)", out), out
    assert re.search(r"enforce\s+kill\s+\(from \$GPU_QUOTA_ENFORCE\)", out), out
    assert re.search(r"on_full\s+cpu-only\s+\(default\)", out), out
    assert re.search(r"park_idle_after\s+1800 s\s+\(from \$GPU_QUOTA_PARK_IDLE_AFTER\)", out), out
    assert re.search(r"park_host_margin\s+2\.0 GiB\s+\(default\)", out), out
    assert re.search(r"park_call_timeout\s+600 s\s+\(default\)", out), out
    assert "0: Check GPU, 40.0 GiB" in out and "a kernel's cap 8.0 GiB, up to 20.0 GiB" in out, out


def test_check_says_why_it_sees_no_gpu(tmp_path):
    # NVML with every device hidden: "no GPU" and why, whether or not this machine has a driver.
    result = gpu_quota(tmp_path, "check", CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 0, result.stderr
    devices = result.stdout.split("devices (NvmlInventory):", 1)[1].splitlines()
    assert devices[1].startswith("  no GPU: "), result.stdout
    assert "starts every kernel without a GPU cap" in result.stdout


@pytest.mark.parametrize(
    "args, env, names",
    [
        ([STATIC, "--GpuQuota.default_cap=abc"], {}, "c.GpuQuota.default_cap = 'abc'"),
        ([STATIC], {"GPU_QUOTA_DEFAULT_CAP": "abc"}, "(from the environment variable GPU_QUOTA_DEFAULT_CAP)"),
        ([STATIC], {"GPU_QUOTA_POLL_INTERVAL": "0"}, "(from the environment variable GPU_QUOTA_POLL_INTERVAL)"),
        (
            [STATIC],
            {"GPU_QUOTA_PLACEMENT": "random"},
            "c.GpuQuota.placement = 'random' (from the environment variable GPU_QUOTA_PLACEMENT)",
        ),
        ([STATIC, "--GpuQuota.on_full=wait"], {}, "c.GpuQuota.on_full = 'wait': must be one of 'refuse', 'cpu-only'"),
        ([STATIC], {"GPU_QUOTA_PARK_IDLE_AFTER": "soon"}, "(from the environment variable GPU_QUOTA_PARK_IDLE_AFTER)"),
        (["--GpuQuota.inventory_class=os.path"], {}, "inventory_class"),
        # Issue 19, item 5: what stops the server beyond the settings' values fails check the same way.
        (
            [STATIC, "--GpuQuota.hard_cap=mps", "--GpuQuota.mps_control=/nonexistent/nvidia-cuda-mps-control"],
            {},
            "c.GpuQuota.hard_cap = 'mps' needs a usable NVIDIA MPS control daemon",
        ),
        ([STATIC], {"GPU_QUOTA_SERVICE_URL": "abc"}, "$GPU_QUOTA_SERVICE_URL = 'abc' is not the URL"),
        (
            [STATIC],
            {"GPU_QUOTA_SERVICE_URL": "http://[::1", "JUPYTERHUB_API_TOKEN": "t"},
            "$GPU_QUOTA_SERVICE_URL = 'http://[::1' is not the URL of a GPU quota service: Invalid IPv6 URL",
        ),
        (
            [STATIC],
            {"GPU_QUOTA_SERVICE_URL": "http://127.0.0.1:9/services/gpu-quota/"},
            "but this server has no JUPYTERHUB_API_TOKEN",
        ),
        ([STATIC, "--GpuQuota.overcommit=True"], {}, "c.GpuQuota.overcommit = 'True': must be a positive number"),
        ([STATIC], {"GPU_QUOTA_OVERCOMMIT": "nan"}, "= 'nan' (from the environment variable GPU_QUOTA_OVERCOMMIT)"),
    ],
)
def test_a_bad_config_fails_check_with_the_servers_own_line(tmp_path, args, env, names):
    result = gpu_quota(tmp_path, "check", *args, **env)
    assert result.returncode == 1
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("gpu-quota-ext: invalid configuration: ") and names in line, line

    server_dir = tmp_path / "server"
    server_dir.mkdir()
    returncode, log = start_server(server_dir, args, env)
    assert returncode not in (None, 0)
    assert [entry for entry in log.splitlines() if "gpu-quota-ext: invalid configuration" in entry] == [line]


def test_an_environment_value_that_config_overrides_is_not_blamed(tmp_path):
    # The command line sets max_cap: its bad value is not the environment's, so no variable is named.
    result = gpu_quota(tmp_path, "check", STATIC, "--GpuQuota.max_cap=2.0", GPU_QUOTA_MAX_CAP="0.5")
    assert result.returncode == 1
    assert "c.GpuQuota.max_cap = '2.0':" in result.stderr and "GPU_QUOTA_MAX_CAP" not in result.stderr


def test_check_refuses_a_config_file_that_does_not_exist(tmp_path):
    result = gpu_quota(tmp_path, "check", f"--config={tmp_path / 'missing.py'}")
    assert result.returncode == 1
    assert "no such file" in result.stderr


def test_check_shows_the_hard_limit_and_stops_what_it_started(tmp_path):
    """hard_cap = "mps" with a usable (fake) control program: check starts the managed daemon as the server
    would, says the layer is on, and leaves no daemon behind."""
    before = set(fake_processes())
    result = gpu_quota(
        tmp_path, "check", STATIC, "--GpuQuota.hard_cap=mps", f"--GpuQuota.mps_control={FAKE_CONTROL}",
        "--GpuQuota.mps_timeout=30", GPU_QUOTA_HARD_LIMIT="cap",
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout.split("hard limit:\n", 1)[1]
    assert re.search(r"hard_cap\s+mps\s+\(from config\)", out), out
    assert re.search(r"hard_limit\s+cap\s+\(from \$GPU_QUOTA_HARD_LIMIT\)", out), out
    assert re.search(r"mps_context_allowance\s+640\.0 MiB\s+\(default\)", out), out
    assert "on: NVIDIA MPS (managed daemon) answered" in out, out
    assert set(fake_processes()) <= before
    assert not list((tmp_path / "runtime").glob("gpu-quota-mps-*"))


def test_a_misspelt_setting_fails_check_and_the_server_warns_of_it_once(tmp_path):
    """Issue 31 item 1: c.GpuQuota.default_caps (for default_cap) in a config file, and another on the command
    line. The check refuses both by name with the setting meant; the server, which runs on (its warning says
    so), says it once per name in the same words instead of traitlets' two guesses between unrelated traits."""
    (tmp_path / "config").mkdir()
    config = tmp_path / "config" / "jupyter_server_config.py"
    config.write_text(
        "c.GpuQuota.inventory_class = 'gpu_quota_ext.devices.StaticInventory'\nc.GpuQuota.default_caps = 0.3\n"
    )
    result = gpu_quota(tmp_path, "check", "--GpuQuota.max_cab=0.5")
    assert result.returncode == 1 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    file_words = "c.GpuQuota.default_caps is not a setting of GpuQuota; did you mean `default_cap`?"
    cli_words = "c.GpuQuota.max_cab is not a setting of GpuQuota; did you mean `max_cap`?"
    assert line.startswith("gpu-quota-ext: invalid configuration: ") and file_words in line and cli_words in line

    config.write_text(config.read_text().replace("default_caps", "default_cap"))
    assert gpu_quota(tmp_path, "check").returncode == 0  # the same file, spelt right, is valid

    config.write_text(config.read_text().replace("default_cap", "default_caps"))
    returncode, log = start_server(tmp_path, ["--GpuQuota.max_cab=0.5"])
    assert returncode is None, log  # serving: a warning, not a refusal
    assert "not recognized" not in log, log  # traitlets' own words, said twice, are gone
    warned = [entry for entry in log.splitlines() if "is not a setting" in entry]
    assert len(warned) == 2 and file_words in warned[0] + warned[1] and cli_words in warned[0] + warned[1], warned
    assert all("ignored" in entry for entry in warned), warned


def test_check_refuses_a_misspelt_static_inventory_setting(tmp_path):
    result = gpu_quota(tmp_path, "check", STATIC, "--StaticInventory.device=[]")
    assert result.returncode == 1
    assert "c.StaticInventory.device is not a setting of StaticInventory; did you mean `devices`?" in result.stderr


def test_check_names_a_misspelt_variable_without_failing(tmp_path):
    # The environment carries other tools' variables too: a note, not a refusal.
    result = gpu_quota(tmp_path, "check", STATIC, GPU_QUOTA_DEFAULT_CAPS="0.3")
    assert result.returncode == 0, result.stderr
    assert (
        "environment: $GPU_QUOTA_DEFAULT_CAPS is set, but nothing reads it; did you mean `GPU_QUOTA_DEFAULT_CAP`?"
        in result.stdout
    ), result.stdout
    assert re.search(r"default_cap\s+0\.25\s+\(default\)", result.stdout), result.stdout
