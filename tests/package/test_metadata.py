"""What a release is made of agrees with itself, read from the files (quick: nothing is built).

The classifiers name exactly the Python versions requires-python allows (from its minimum up to the newest
listed), and `./run` asks for that same minimum; LICENSE, pyproject and the labextension's package.json
say the same license; package.json's version is the package's (scripts/labextension_version.py keeps it
so at each release, in npm's spelling); CHANGELOG.md has the markers jupyter-releaser writes between; the
release workflows use jupyter-releaser's actions.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    tomllib = pytest.importorskip("tomli")
import yaml

from .scripts import labextension_version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]


def minimum_python() -> tuple:
    match = re.fullmatch(r">=\s*3\.(\d+)", PROJECT["requires-python"])
    assert match, PROJECT["requires-python"]
    return 3, int(match.group(1))


def test_the_classifiers_python_versions_are_those_requires_python_allows():
    versions = [re.fullmatch(r"Programming Language :: Python :: 3\.(\d+)", c) for c in PROJECT["classifiers"]]
    listed = sorted((3, int(m.group(1))) for m in versions if m)
    assert listed, PROJECT["classifiers"]
    assert listed[0] == minimum_python()
    assert listed == [(3, minor) for minor in range(listed[0][1], listed[-1][1] + 1)]  # none skipped
    assert "Programming Language :: Python :: 3 :: Only" in PROJECT["classifiers"]


def test_run_asks_for_the_python_the_package_requires():
    run = (ROOT / "run").read_text(encoding="utf-8")
    (minimum,) = re.findall(r"^MIN_PYTHON=(\d+\.\d+)\b", run, re.MULTILINE)
    assert tuple(int(part) for part in minimum.split(".")) == minimum_python()


def test_one_license_everywhere():
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert license_text.startswith("BSD 3-Clause License\n")
    assert re.search(r"^Copyright \(c\) \d{4}, gpu-quota-ext contributors$", license_text, re.MULTILINE)
    assert PROJECT["license"] == "BSD-3-Clause" and PROJECT["license-files"] == ["LICENSE"]
    assert json.loads((ROOT / "labextension" / "package.json").read_text())["license"] == "BSD-3-Clause"
    assert "License :: " not in " ".join(PROJECT["classifiers"])  # PEP 639: the expression says it, once


def test_the_labextensions_version_is_the_packages():
    assert labextension_version.main(["--check"]) == 0


@pytest.mark.parametrize(
    "pep440, npm",
    [("0.1.0", "0.1.0"), ("1.2.3a1", "1.2.3-alpha.1"), ("1.2.3b2", "1.2.3-beta.2"), ("1.2.3rc1", "1.2.3-rc.1"),
     ("0.2.0.dev0", "0.2.0-dev.0"), ("0.2.0rc1.dev4", "0.2.0-rc.1.dev.4")],
)
def test_npm_spelling_of_a_version(pep440, npm):
    assert labextension_version.npm_version(pep440) == npm


@pytest.mark.parametrize("version", ["0.1", "1.0.0.post1", "1!1.0.0", "1.0.0+local", "1.0.0-alpha.1", ""])
def test_a_version_with_no_npm_spelling_is_refused(version):
    with pytest.raises(ValueError, match="no npm spelling"):
        labextension_version.npm_version(version)


def test_the_version_hook_writes_only_the_version(tmp_path):
    (tmp_path / "gpu_quota_ext").mkdir()
    (tmp_path / "labextension").mkdir()
    (tmp_path / "gpu_quota_ext" / "__init__.py").write_text('"""doc"""\n\n__version__ = "0.3.0rc2"\n')
    original = (ROOT / "labextension" / "package.json").read_text(encoding="utf-8")
    (tmp_path / "labextension" / "package.json").write_text(original)

    assert labextension_version.main(["--check"], root=tmp_path) == 1
    assert labextension_version.main([], root=tmp_path) == 0
    assert labextension_version.main(["--check"], root=tmp_path) == 0
    written = (tmp_path / "labextension" / "package.json").read_text()
    changed = [(a, b) for a, b in zip(original.splitlines(), written.splitlines()) if a != b]
    assert changed == [(f'  "version": "{json.loads(original)["version"]}",', '  "version": "0.3.0-rc.2",')]
    assert len(written.splitlines()) == len(original.splitlines()) and written.endswith("}\n")


def test_the_changelog_has_the_releasers_markers_and_an_unreleased_section():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    start, end = "<!-- <START NEW CHANGELOG ENTRY> -->", "<!-- <END NEW CHANGELOG ENTRY> -->"
    assert text.count(start) == 1 and text.count(end) == 1 and text.index(start) < text.index(end)
    assert re.search(r"^## \[?Unreleased\]?$", text, re.MULTILINE)


def test_the_release_workflows_use_jupyter_releasers_actions():
    workflows = ROOT / ".github" / "workflows"
    steps = {}
    for name in ("check-release.yml", "prep-release.yml", "publish-release.yml"):
        workflow = yaml.safe_load((workflows / name).read_text(encoding="utf-8"))
        steps[name] = [step.get("uses", "") for job in workflow["jobs"].values() for step in job["steps"]]
    releaser = "jupyter-server/jupyter_releaser/.github/actions/"

    def uses(workflow: str, action: str) -> bool:
        return any(used.startswith(f"{releaser}{action}@") for used in steps[workflow])

    assert uses("check-release.yml", "check-release")
    assert uses("prep-release.yml", "prep-release")
    assert uses("publish-release.yml", "populate-release") and uses("publish-release.yml", "finalize-release")


def test_the_releasers_hooks_name_files_that_exist():
    hooks = PYPROJECT["tool"]["jupyter-releaser"]["hooks"]
    scripts = re.findall(r"python (scripts/\S+\.py)", " ".join(cmd for cmds in hooks.values() for cmd in cmds))
    assert scripts and all((ROOT / script).is_file() for script in scripts), scripts
