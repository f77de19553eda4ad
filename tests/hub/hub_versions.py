"""Which JupyterHub majors the real-hub tests run on, and a Python for each: every major the `[hub]` extra
allows (pyproject.toml). The tests' own Python serves the major installed in it; every other major gets a
virtual environment of its own, tests/hub/.versions/jhN/ (ignored by git), with that major's newest
JupyterHub and this package's runtime dependencies (the package itself comes by PYTHONPATH: the host
service runs under the hub's Python).

    python tests/hub/hub_versions.py install      what tests/hub/setup.sh runs: makes what is missing
    python tests/hub/hub_versions.py requirement  the [hub] extra's JupyterHub requirement

Stdlib only: it runs before anything else is installed. A second `install` installs nothing (a stamp in
each environment records what it was made from; a changed pyproject.toml makes it again).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

try:
    import tomllib
except ImportError:  # Python 3.10 (the oldest the tests run on): pip carries the same parser
    from pip._vendor import tomli as tomllib

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VERSIONS = HERE / ".versions"
STAMP = "gpu-quota-ext-requirements.txt"


def _project() -> dict:
    with open(REPO / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["project"]


def hub_requirement() -> str:
    """The `[hub]` extra's JupyterHub requirement, e.g. "jupyterhub>=4.1,<7"."""
    (requirement,) = [r for r in _project()["optional-dependencies"]["hub"] if re.match(r"jupyterhub\b", r)]
    return requirement


def allowed_majors(requirement: str) -> List[int]:
    """The majors a ">=A.B,<C" (or "<C.D") requirement allows: [A, ..., C-1] (and C when C.D > C.0)."""
    match = re.fullmatch(r"jupyterhub\s*>=\s*(\d+)(?:\.\d+)*\s*,\s*<\s*(\d+)((?:\.\d+)*)", requirement.strip())
    if not match:
        raise ValueError(f"tests/hub/hub_versions.py reads only 'jupyterhub>=A.B,<C' in the [hub] extra: {requirement}")
    low, high, rest = int(match.group(1)), int(match.group(2)), match.group(3)
    last = high if rest.strip(".0") else high - 1
    return list(range(low, last + 1))


def runtime_requirements() -> List[str]:
    return list(_project()["dependencies"])


def requirements_for(major: int) -> List[str]:
    """What an environment for `major` is made from: the extra's JupyterHub narrowed to that major."""
    return [f"{hub_requirement()},=={major}.*", *runtime_requirements()]


def version_of(python: str = sys.executable) -> Optional[str]:
    """The JupyterHub version `python` imports, or None."""
    if python == sys.executable:
        try:
            import jupyterhub
        except ImportError:
            return None
        return jupyterhub.__version__
    code = "import jupyterhub; print(jupyterhub.__version__)"
    asked = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return asked.stdout.strip() if asked.returncode == 0 else None


def _major(version: Optional[str]) -> Optional[int]:
    return int(version.split(".")[0]) if version else None


def environment(major: int) -> Path:
    return VERSIONS / f"jh{major}"


def _wanted(major: int) -> str:
    return "\n".join(requirements_for(major)) + "\n"


def _ready(major: int) -> bool:
    stamp = environment(major) / STAMP
    return (environment(major) / "bin" / "python").exists() and stamp.exists() and stamp.read_text() == _wanted(major)


def python_for(major: int) -> Tuple[Optional[str], str]:
    """(a Python whose JupyterHub is `major`, "") or (None, what is missing)."""
    if _major(version_of()) == major:
        return sys.executable, ""
    if _ready(major):
        return str(environment(major) / "bin" / "python"), ""
    return None, f"no environment for JupyterHub {major} ({requirements_for(major)[0]}) at {environment(major)}"


def install() -> None:
    """Make the environment of every allowed major that the tests' Python does not serve and is not made yet."""
    for major in allowed_majors(hub_requirement()):
        if _major(version_of()) == major or _ready(major):
            continue
        folder, wanted = environment(major), _wanted(major)
        print(f"tests/hub/hub_versions.py: making {folder} for {requirements_for(major)[0]}", flush=True)
        (folder / STAMP).unlink(missing_ok=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(folder)], check=True)
        python, requirements = str(folder / "bin" / "python"), folder / "requirements.txt"
        requirements.write_text(wanted)
        pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r", str(requirements)]
        subprocess.run(pip, check=True)
        if _major(version_of(python)) != major:
            raise SystemExit(f"tests/hub/hub_versions.py: {folder} has no JupyterHub {major} after pip install")
        (folder / STAMP).write_text(wanted)  # last: an install cut short is made again next time


def summary() -> str:
    """One line: which JupyterHub each allowed major runs on here."""
    parts = []
    for major in allowed_majors(hub_requirement()):
        python, _ = python_for(major)
        if python is None:
            parts.append(f"{major}: MISSING")
        else:
            where = "this Python" if python == sys.executable else environment(major).relative_to(REPO)
            parts.append(f"{major}: {version_of(python)} ({where})")
    return "JupyterHub " + ", ".join(parts)


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "requirement":
        print(hub_requirement())
    elif command == "install":
        install()
        print(f"tests/hub/hub_versions.py: {summary()}")
    else:
        raise SystemExit("usage: python tests/hub/hub_versions.py install | requirement")
