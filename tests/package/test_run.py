"""`./run`'s setup decisions, without installing anything: when it (re)installs .venv and when it rebuilds
the JupyterLab extension (its shell functions, sourced with RUN_SOURCED=1 in a scratch folder), and
scripts/check_install.py, which tells it whether .venv's install still works (after `pip uninstall
gpu-quota-ext` the stamp file survives; the check does not).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .scripts import check_install

ROOT = Path(__file__).resolve().parents[2]


def run_function(folder: Path, call: str) -> str:
    """`call` in bash with ./run's functions loaded, in `folder` (a stand-in checkout); its stdout."""
    result = subprocess.run(
        ["bash", "-c", f'RUN_SOURCED=1 source "{ROOT / "run"}"; {call}'],
        cwd=folder, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def set_mtime(path: Path, seconds_ago: float) -> None:
    when = path.stat().st_mtime - seconds_ago
    os.utime(path, (when, when))


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A checkout as ./run sees it: pyproject.toml, a .venv whose python answers as FAKE_CHECK says."""
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    # The check's stand-in: prints FAKE_CHECK_SAYS and exits FAKE_CHECK_STATUS (the real one: tests below).
    python.write_text('#!/bin/sh\nprintf "%s" "${FAKE_CHECK_SAYS:-}"\nexit "${FAKE_CHECK_STATUS:-0}"\n')
    python.chmod(0o755)
    return tmp_path


def stamp(checkout: Path, extra: str = "lab") -> Path:
    path = checkout / ".venv" / f".gpu-quota-ext-{extra}"
    path.write_text("")
    set_mtime(checkout / "pyproject.toml", 60)  # the stamp is newer than pyproject.toml
    return path


# --- install_reason: when ./run installs ---------------------------------------------------------------


def test_a_first_setup_installs(checkout):
    assert run_function(checkout, "install_reason lab") == "first setup of [lab]"


def test_a_changed_pyproject_reinstalls(checkout):
    path = stamp(checkout)
    set_mtime(path, 120)
    assert run_function(checkout, "install_reason lab") == "pyproject.toml changed since the last setup"


def test_a_stamp_with_a_working_install_installs_nothing(checkout):
    stamp(checkout)
    assert run_function(checkout, "FAKE_CHECK_STATUS=0 install_reason lab") == ""


def test_a_stamp_over_a_broken_install_reinstalls_and_says_why(checkout):
    stamp(checkout)
    said = run_function(checkout, "FAKE_CHECK_SAYS='gpu-quota-ext is not installed' FAKE_CHECK_STATUS=1 "
                                  "install_reason lab")
    assert said == "gpu-quota-ext is not installed"
    assert run_function(checkout, "FAKE_CHECK_STATUS=1 install_reason lab") == "scripts/check_install.py failed"


def test_each_extra_has_its_own_stamp(checkout):
    stamp(checkout, "lab")
    assert run_function(checkout, "install_reason test") == "first setup of [test]"


def test_before_pip_installs_the_develop_link_goes_and_a_real_folder_stays(checkout):
    # `pip uninstall gpu-quota-ext` deleted what the link pointed to and left it dangling: pip's next install
    # would fail writing install.json through it.
    labextensions = checkout / ".venv" / "share" / "jupyter" / "labextensions"
    labextensions.mkdir(parents=True)
    link = labextensions / "gpu-quota-ext"
    link.symlink_to(checkout / "gpu_quota_ext" / "labextension")  # dangling: that folder does not exist
    run_function(checkout, "unlink_develop_link")
    assert not link.is_symlink() and not link.exists()
    link.mkdir()  # an installed copy (a wheel's), not a link: pip's to manage
    (link / "package.json").write_text("{}")
    run_function(checkout, "unlink_develop_link")
    assert (link / "package.json").exists()


# --- labextension_build_reason: when ./run rebuilds the JupyterLab extension ------------------------------


def test_the_extension_is_built_when_missing_or_older_than_a_source(checkout):
    sources = checkout / "labextension"
    for name in ("src/index.ts", "style/base.css", "schema/plugin.json", "package.json", "tsconfig.json"):
        (sources / name).parent.mkdir(parents=True, exist_ok=True)
        (sources / name).write_text("")
        set_mtime(sources / name, 60)
    assert run_function(checkout, "labextension_build_reason") == "not built yet"

    built = checkout / "gpu_quota_ext" / "labextension" / "static" / "style.js"
    built.parent.mkdir(parents=True)
    built.write_text("")
    assert run_function(checkout, "labextension_build_reason") == ""

    (sources / "src" / "index.ts").write_text("// changed")
    set_mtime(built, 60)
    assert run_function(checkout, "labextension_build_reason") == "its sources changed"


# --- check_install.py: whether the install works ---------------------------------------------------------


def facts(**changes) -> check_install.Facts:
    working = dict(
        installed_version="0.1.0", source_version="0.1.0", editable_from=ROOT, imported_from=ROOT / "gpu_quota_ext",
        labextension=True, server_config=True, missing=[],
    )
    working.update(changes)
    return check_install.Facts(**working)


@pytest.mark.parametrize(
    "changes, said",
    [
        ({}, None),
        ({"installed_version": None}, "gpu-quota-ext is not installed"),
        ({"editable_from": None}, "installed not as an editable install, not from this checkout"),
        ({"editable_from": Path("/elsewhere")}, "installed from /elsewhere, not from this checkout"),
        ({"imported_from": None}, "import gpu_quota_ext finds nothing"),
        ({"installed_version": "0.0.9"}, "the installed metadata says version 0.0.9, the source 0.1.0"),
        ({"server_config": False}, "the server extension's config is missing"),
        ({"labextension": False}, "the JupyterLab extension is missing or unbuilt"),
        ({"missing": ["jupyterlab<5,>=4.2"]}, "gpu-quota-ext[lab] needs what is not installed: jupyterlab<5,>=4.2"),
    ],
)
def test_the_check_names_the_first_problem(changes, said):
    found = check_install.problem(facts(**changes), ROOT, "lab")
    assert found == said if said is None else said in found


def test_the_check_reads_an_extras_requirements_through_the_packages_own_extras(tmp_path):
    info = tmp_path / "gpu_quota_ext-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: gpu-quota-ext\nVersion: 0.1.0\n"
        "Requires-Dist: pytest\n"
        "Requires-Dist: gpu-quota-ext[hub]; extra == 'lab'\n"
        "Requires-Dist: surely-not-installed-here>=1; extra == 'lab'\n"
        "Requires-Dist: pytest>=1000; extra == 'hub'\n"
        "Requires-Dist: also-not-installed; extra == 'other'\n"
    )
    dist = importlib.metadata.PathDistribution(info)
    pytest_version = importlib.metadata.version("pytest")
    assert check_install.missing_requirements(dist, ["", "lab"]) == [
        f"pytest>=1000 (found {pytest_version})", "surely-not-installed-here>=1",
    ]
    assert check_install.missing_requirements(dist, [""]) == []


def test_in_a_venv_without_the_package_the_check_says_so(tmp_path):
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    result = subprocess.run(
        [str(venv / "bin" / "python"), str(ROOT / "scripts" / "check_install.py"), "lab"],
        capture_output=True, text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert (result.returncode, result.stdout.strip()) == (1, "gpu-quota-ext is not installed")


def test_the_tests_own_install_passes_the_check_for_its_checkout():
    folder = check_install.editable_folder(importlib.metadata.distribution("gpu-quota-ext"))
    if folder is None:
        pytest.skip("gpu-quota-ext is not installed editable here")
    # The check looks at where `import gpu_quota_ext` goes: without PYTHONPATH, as ./run runs it.
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import check_install; "
            "sys.exit(check_install.main(['test'], Path(sys.argv[2])))")
    result = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "scripts"), str(folder)], capture_output=True, text=True, timeout=60,
        cwd="/", env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert (result.returncode, result.stdout) == (0, ""), result.stdout + result.stderr
