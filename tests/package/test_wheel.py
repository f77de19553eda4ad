"""The package a user installs, checked from a built wheel, not from this checkout.

`python -m build` makes the sdist from the checkout and then the wheel FROM THAT SDIST, the way a release
builds them: a wheel that builds proves the sdist holds what a rebuild needs. A development build's
leftovers are planted in the unpacked sdist first: the wheel must be the production build a fresh clone
gives. The build needs Node.js (jlpm installs the extension's npm dependencies in the unpacked sdist and
builds it for production). The wheel then goes into a fresh virtual environment (no system site-packages,
no PYTHONPATH, a PATH with that environment's bin/ only, so no Node.js) with its dependencies from this
machine's pip index, as `pip install gpu_quota_ext-*.whl[lab]`; from there: the server extension is
enabled by the wheel's own config, the labextension is listed and served, a kernel started through REST
has `%gpucap`, and a cap request goes through the installed server.

Everything the build and the install write goes under pytest's tmp dir (pip's and yarn's download caches
are the user's, as for any install); the checkout's `git status` is the same after as before.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from ..integration.servers import TOKEN, Server
from ..kernel_transport import short_directory
from .scripts import labextension_version

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # a whole build, a venv, a server

CHECKOUT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
GiB = 1 << 30


def checkout_version() -> str:
    """The one source, read as hatch reads it (gpu_quota_ext/__init__.py), not through an import."""
    text = (CHECKOUT / "gpu_quota_ext" / "__init__.py").read_text(encoding="utf-8")
    return re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE).group(1)


def git_status() -> Optional[str]:
    if not (CHECKOUT / ".git").exists():
        return None
    return subprocess.run(
        ["git", "status", "--porcelain"], cwd=CHECKOUT, capture_output=True, text=True, check=True
    ).stdout


def run_logged(command: List[str], log: Path, env: Dict[str, str], cwd: Path, timeout: float) -> float:
    """Run to completion with its output in `log`; seconds taken. A failure shows the log's end."""
    started = time.monotonic()
    with log.open("w") as out:
        result = subprocess.run(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}:\n" + log.read_text()[-6000:])
    return time.monotonic() - started


def without_checkout(extra: Dict[str, str]) -> Dict[str, str]:
    """This environment, less what would put the checkout's package in front of the installed one."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("GPU_QUOTA_")}
    env.update(extra)
    return env


@dataclass
class Dists:
    sdist: Path
    wheel: Path
    work: Path
    tree: Path  # the unpacked sdist the wheel was built in, a development build's leftovers planted first
    status_before: Optional[str]
    build_seconds: float


# What a development build (`jlpm build`, as `./run lab` runs it) leaves in a clone, imitated: the built
# extension with source maps and chunks of another build, TypeScript's output and its incremental state. A
# wheel built in that tree must hold none of it. Paths from the tree's root.
LEFTOVER_MARK = "left by an earlier development build"
EXTENSION_OUTPUT = "gpu_quota_ext/labextension"
LEFTOVERS = (
    f"{EXTENSION_OUTPUT}/package.json",
    f"{EXTENSION_OUTPUT}/build_log.json",
    f"{EXTENSION_OUTPUT}/static/style.js",
    f"{EXTENSION_OUTPUT}/static/remoteEntry.0123456789abcdef.js",
    f"{EXTENSION_OUTPUT}/static/remoteEntry.0123456789abcdef.js.map",
    f"{EXTENSION_OUTPUT}/static/lib_index_js.0123456789abcdef.js",
    f"{EXTENSION_OUTPUT}/static/lib_index_js.0123456789abcdef.js.map",
    "labextension/lib/index.js",
    "labextension/lib/index.js.map",
    "labextension/tsconfig.tsbuildinfo",
)


def plant_leftovers(tree: Path) -> None:
    for name in LEFTOVERS:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"note": LEFTOVER_MARK}) if name.endswith(".json") else f"// {LEFTOVER_MARK}"
        (tree / name).write_text(text + "\n")


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> Dists:
    """The sdist from the checkout, and the wheel built in that sdist unpacked (a release builds its wheel
    from its sdist) with a development build's leftovers planted in it: the wheel of a used clone."""
    work = tmp_path_factory.mktemp("build")
    (work / "tmp").mkdir()
    assert shutil.which("node"), "building the wheel needs Node.js (jlpm builds the labextension)"
    status_before = git_status()
    # TMPDIR: build's isolated environments; they are thrown away (no .pyc needed).
    env = without_checkout({"TMPDIR": str(work / "tmp"), "PIP_NO_COMPILE": "1"})
    seconds = run_logged(
        [sys.executable, "-m", "build", "--sdist", "--outdir", str(work / "dist"), str(CHECKOUT)],
        work / "sdist.log", env, work, timeout=300,
    )
    (sdist,) = (work / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        # The "data" filter where this Python has it (3.10.12+): our own sdist, but no reason to trust more.
        archive.extractall(work / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (tree,) = (work / "unpacked").iterdir()
    plant_leftovers(tree)
    seconds += run_logged(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(work / "dist"), str(tree)],
        work / "wheel.log", env, work, timeout=1200,
    )
    (wheel,) = (work / "dist").glob("*.whl")
    print(f"python -m build (the sdist, then the wheel in it unpacked): {seconds:.0f} s")
    return Dists(sdist, wheel, work, tree, status_before, seconds)


@dataclass
class Installation:
    venv: Path
    home: Path
    install_seconds: float

    def environment(self) -> Dict[str, str]:
        """A user's shell with only this venv on PATH: nothing of the test's Python, no Node.js."""
        return {
            "HOME": str(self.home),
            "PATH": str(self.venv / "bin"),
            "LANG": "C.UTF-8",
            "JUPYTER_CONFIG_DIR": str(self.home / "jupyter-config"),
            "JUPYTER_DATA_DIR": str(self.home / "jupyter-data"),
            "JUPYTER_RUNTIME_DIR": str(self.home / "jupyter-runtime"),
        }

    def run(self, *command: str) -> str:
        """A command of the venv, as its user types it; stdout and stderr together, colours removed."""
        result = subprocess.run(
            [str(self.venv / "bin" / command[0]), *command[1:]], env=self.environment(), cwd=self.home,
            capture_output=True, text=True, timeout=300,
        )
        out = ANSI.sub("", result.stdout + result.stderr)
        assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{out}"
        return out


@pytest.fixture(scope="module")
def installed(dists, tmp_path_factory) -> Installation:
    root = tmp_path_factory.mktemp("user")
    venv, home = root / "venv", root / "home"
    home.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # This Python's pip installs into the new venv (--python): the same index, the same download cache,
    # none of this venv's packages. --no-compile: the venv's first imports compile what they use.
    seconds = run_logged(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-compile",
         f"{dists.wheel}[lab]"],
        root / "install.log", without_checkout({"TMPDIR": str(dists.work / "tmp")}), root, timeout=900,
    )
    print(f"pip install gpu_quota_ext-*.whl[lab] into a fresh venv: {seconds:.0f} s")
    return Installation(venv, home, seconds)


class InstalledServer(Server):
    """`jupyter server` of the venv the wheel went into: its Python, the user's environment, and nothing on
    its command line that enables the extension (the wheel's etc/jupyter config does)."""

    enabling_args = ()

    def __init__(self, installation: Installation, runtime: Path, config: dict):
        self.python = str(installation.venv / "bin" / "python")
        self.cwd = installation.home
        self.installation = installation
        super().__init__(runtime, [], config=config)

    def base_environment(self) -> dict:
        return self.installation.environment()

    def text(self, path: str) -> str:
        request = urllib.request.Request(self.url() + path, headers={"Authorization": f"token {TOKEN}"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert answer.status == 200, (path, answer.status)
            return answer.read().decode()


@pytest.fixture(scope="module")
def server(installed, short_tmp):
    config = {
        # No ServerApp.jpserver_extensions here: the wheel's jupyter_server_config.d enables the extension.
        "GpuQuota": {
            "inventory_class": "gpu_quota_ext.devices.StaticInventory", "default_cap": "0.25", "max_cap": "0.5",
        },
        "StaticInventory": {"devices": [{"name": "Wheel GPU 0", "total": "80GiB"}]},
    }
    started = InstalledServer(installed, short_directory(short_tmp), config)
    try:
        started.wait_serving(timeout=120)
        yield started
    finally:
        started.kill()


# --- what was built --------------------------------------------------------------------------------


def test_the_sdist_is_the_source_a_rebuild_needs_and_nothing_built(dists):
    with tarfile.open(dists.sdist) as archive:
        names = [name.split("/", 1)[1] for name in archive.getnames() if "/" in name]
    files = set(names)
    for needed in ("pyproject.toml", "LICENSE", "README.md", "labextension/package.json", "labextension/yarn.lock",
                   "labextension/.yarnrc.yml", "labextension/install.json",
                   "jupyter-config/jupyter_server_config.d/gpu_quota_ext.json"):
        assert needed in files, needed
    assert any(name.startswith("labextension/src/") and name.endswith(".ts") for name in files)
    built = [n for n in files
             if "node_modules/" in n or "/__pycache__/" in n or n.endswith((".tsbuildinfo", ".pyc", ".whl"))
             or n.startswith(("gpu_quota_ext/labextension/", "labextension/lib/"))]
    assert built == [], built
    if dists.status_before is not None:  # a git checkout: every tracked source file of the package is there
        tracked = subprocess.run(["git", "ls-files"], cwd=CHECKOUT, capture_output=True, text=True, check=True).stdout
        package_folders = ("gpu_quota_ext/", "labextension/", "jupyter-config/")
        wanted = {p for p in tracked.splitlines() if p.startswith(package_folders)}
        assert wanted - files == set()


def test_the_wheel_has_the_built_extension_and_no_tests_or_machine_paths(dists):
    version = checkout_version()
    assert dists.wheel.name == f"gpu_quota_ext-{version}-py3-none-any.whl"
    data = f"gpu_quota_ext-{version}.data/data/"
    with zipfile.ZipFile(dists.wheel) as wheel:
        names = wheel.namelist()
        contents = {name: wheel.read(name) for name in names}
    extension = data + "share/jupyter/labextensions/gpu-quota-ext/"
    assert extension + "package.json" in names and extension + "install.json" in names
    assert any(re.fullmatch(re.escape(extension) + r"static/remoteEntry\.[0-9a-f]+\.js", n) for n in names)
    assert data + "etc/jupyter/jupyter_server_config.d/gpu_quota_ext.json" in names
    assert f"gpu_quota_ext-{version}.dist-info/licenses/LICENSE" in names
    tests = [n for n in names
             if n.startswith("tests/") or "/tests/" in n or re.search(r"(^|/)(test_\w+|conftest)\.py$", n)]
    assert tests == []
    assert not [n for n in names if n.endswith("build_log.json")]  # JupyterLab's builder log: absolute paths
    machine = [str(CHECKOUT), str(dists.work), os.path.expanduser("~") + "/", "/tmp/pip-", "/tmp/build-"]
    leaked = [(n, p) for n, blob in contents.items() for p in machine if p.encode() in blob]
    assert leaked == []
    metadata = contents[f"gpu_quota_ext-{version}.dist-info/METADATA"].decode()
    assert f"\nVersion: {version}\n" in metadata and "\nLicense-Expression: BSD-3-Clause\n" in metadata
    assert "\nAuthor: gpu-quota-ext contributors\n" in metadata


def test_the_wheel_is_a_production_build_whatever_was_built_before(dists):
    """Issue 31, item 4: the same file list from a fresh clone and from a used one. The wheel was built in a
    tree with a development build's leftovers (LEFTOVERS): it holds the production build the wheel's build
    made from nothing (what `build:prod` wrote, after removing everything an earlier build left), no source
    map, none of the leftovers."""
    extension = f"gpu_quota_ext-{checkout_version()}.data/data/share/jupyter/labextensions/gpu-quota-ext/"
    with zipfile.ZipFile(dists.wheel) as wheel:
        names = wheel.namelist()
        marked = [n for n in names if LEFTOVER_MARK.encode() in wheel.read(n)]
    assert [n for n in names if n.endswith(".map")] == []
    assert marked == []
    shipped = {n[len(extension):] for n in names if n.startswith(extension)}
    output = dists.tree / EXTENSION_OUTPUT
    built = {p.relative_to(output).as_posix() for p in output.rglob("*") if p.is_file()}
    # The build removed every leftover (some names it writes again, of its own making).
    left = [tree_file for tree_file in map(dists.tree.joinpath, LEFTOVERS) if tree_file.exists()]
    assert [str(f) for f in left if LEFTOVER_MARK in f.read_text()] == []
    # The wheel leaves out the builder's log (absolute paths) and adds install.json (labextension/install.json).
    assert shipped == (built - {"build_log.json"}) | {"install.json"}
    assert "static/style.js" in shipped and any(re.fullmatch(r"static/remoteEntry\.[0-9a-f]+\.js", n) for n in shipped)


# --- what a user gets from it ----------------------------------------------------------------------


def test_a_fresh_venv_without_node_holds_the_wheels_package(installed):
    assert "include-system-site-packages = false" in (installed.venv / "pyvenv.cfg").read_text()
    assert shutil.which("node", path=installed.environment()["PATH"]) is None
    where = installed.run("python", "-c", "import gpu_quota_ext; print(gpu_quota_ext.__file__)").strip()
    assert where.startswith(str(installed.venv / "lib")), where
    assert installed.run("jupyter", "gpu-quota", "--version").strip() == checkout_version()


def test_the_server_extension_is_enabled_by_the_wheels_config(installed):
    out = installed.run("jupyter", "server", "extension", "list")
    own = out.split(f"Config dir: {installed.venv}/etc/jupyter", 1)
    assert len(own) == 2, out
    section = own[1].split("Config dir:", 1)[0]
    assert re.search(r"^\s+gpu_quota_ext enabled$", section, re.MULTILINE), out
    assert re.search(rf"^\s+gpu_quota_ext {re.escape(checkout_version())} OK$", section, re.MULTILINE), out


def test_the_labextension_is_listed_from_the_venv(installed):
    out = installed.run("jupyter", "labextension", "list")
    listing = out.split(f"{installed.venv}/share/jupyter/labextensions", 1)
    assert len(listing) == 2, out
    version = re.escape(labextension_version.npm_version(checkout_version()))
    line = rf"^\s+gpu-quota-ext v{version} enabled OK \(python, gpu-quota-ext\)$"
    assert re.search(line, listing[1], re.MULTILINE), out


def test_the_installed_server_serves_the_sidebars_code(server):
    page = server.text("/lab")
    config_data = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', page, re.S)
    config = json.loads(config_data.group(1))
    (ours,) = [e for e in config["federated_extensions"] if e["name"] == "gpu-quota-ext"]
    script = server.text(f"/lab/extensions/gpu-quota-ext/{ours['load']}")
    assert "gpu-quota-ext" in script


def test_a_kernel_of_the_installed_server_has_gpucap(server):
    kernel_id = server.start_kernel()
    where = server.run(kernel_id, "import gpu_quota_ext, sys; print(gpu_quota_ext.__file__); print(sys.prefix)")
    package_file, prefix = where.split()
    assert prefix == str(server.installation.venv) and package_file.startswith(prefix), where

    table = server.run(kernel_id, "%gpucap")
    row = table.splitlines()[1]
    assert row.startswith("cuda:0 (server GPU "), table
    assert "20.0 GiB" in row and "80.0 GiB" in row and "the server, at kernel start" in row, table
    assert "you may ask for up to 40.0 GiB" in table

    granted = server.run(kernel_id, "%gpucap 0.3")
    assert "gpu-quota: granted" in granted and "cap now 24.0 GiB on cuda:0" in granted, granted
    record = server.api(f"/api/gpu-quota/kernels/{kernel_id}")
    assert [d["cap"] for d in record["devices"]] == [int(0.3 * 80 * GiB)]


def test_building_and_installing_left_the_checkout_as_it_was(dists, installed):
    print(f"build {dists.build_seconds:.0f} s, install {installed.install_seconds:.0f} s")
    if dists.status_before is None:
        pytest.skip("not a git checkout")
    assert git_status() == dists.status_before
