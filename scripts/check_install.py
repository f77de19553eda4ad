"""Whether this Python's environment holds a working install of gpu-quota-ext from this checkout, for
`./run EXTRA` (lab or test): prints the first problem in one line and exits 1; prints nothing and exits 0
when the install can serve.

./run asks it with .venv's Python before it starts anything, so that a `pip uninstall gpu-quota-ext`, a
removed or unbuilt JupyterLab extension, an install from another checkout or a missing dependency is set
up again, instead of JupyterLab starting without the extension. It reads metadata and files only: nothing
is imported from the package, nothing is started.

    .venv/bin/python scripts/check_install.py lab
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parent.parent
DIST = "gpu-quota-ext"
PACKAGE = "gpu_quota_ext"
LABEXTENSION = Path("share", "jupyter", "labextensions", "gpu-quota-ext")
SERVER_CONFIG = Path("etc", "jupyter", "jupyter_server_config.d", "gpu_quota_ext.json")


@dataclass
class Facts:
    """What gather() found; problem() judges it."""

    installed_version: Optional[str]  # the distribution's metadata; None: not installed
    source_version: str  # gpu_quota_ext/__init__.py of the checkout
    editable_from: Optional[Path] = None  # the folder of an editable install; None: not editable
    imported_from: Optional[Path] = None  # the folder `import gpu_quota_ext` would load; None: not found
    labextension: bool = False  # the built extension where JupyterLab looks (package.json and remoteEntry)
    server_config: bool = False  # the config file that enables the server extension
    missing: List[str] = field(default_factory=list)  # requirements not installed or of another version


def problem(facts: Facts, root: Path, extra: str) -> Optional[str]:
    """The first reason the install cannot serve `./run EXTRA`, in words; None when it can."""
    if facts.installed_version is None:
        return f"{DIST} is not installed"
    if facts.editable_from is None or facts.editable_from != root:
        where = "not as an editable install" if facts.editable_from is None else f"from {facts.editable_from}"
        return f"{DIST} is installed {where}, not from this checkout ({root})"
    if facts.imported_from != root / PACKAGE:
        return f"import {PACKAGE} finds {facts.imported_from or 'nothing'}, not {root / PACKAGE}"
    if facts.installed_version != facts.source_version:
        return f"the installed metadata says version {facts.installed_version}, the source {facts.source_version}"
    if not facts.server_config:
        return f"the server extension's config is missing ({SERVER_CONFIG})"
    if not facts.labextension:
        return f"the JupyterLab extension is missing or unbuilt ({LABEXTENSION})"
    if facts.missing:
        return f"{DIST}[{extra}] needs what is not installed: {', '.join(facts.missing)}"
    return None


def source_version(root: Path) -> str:
    text = (root / PACKAGE / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", text, re.MULTILINE)
    return match.group(1) if match else "unknown"


def editable_folder(dist: importlib.metadata.Distribution) -> Optional[Path]:
    """The folder of an editable install, from its direct_url.json (PEP 610)."""
    text = dist.read_text("direct_url.json")
    if not text:
        return None
    record = json.loads(text)
    if not record.get("dir_info", {}).get("editable") or not record.get("url", "").startswith("file:"):
        return None
    return Path(unquote(urlparse(record["url"]).path)).resolve()


def missing_requirements(dist: importlib.metadata.Distribution, extras: List[str]) -> List[str]:
    """The distribution's requirements, with those of `extras` (its own extras followed), not satisfied here."""
    try:
        from packaging.requirements import Requirement  # jupyter_server's dependency: here when the package is
    except ImportError:
        return ["packaging (a dependency of jupyter_server)"]

    missing: List[str] = []
    wanted, seen = list(extras), set()
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
                continue
            if requirement.marker is None and extra != "":
                continue  # a base requirement: checked once, under the extra ""
            if requirement.name.replace("_", "-").lower() == DIST:
                wanted.extend(requirement.extras)
                continue
            wanted_version = f"{requirement.name}{requirement.specifier}"  # without the extra's marker
            try:
                version = importlib.metadata.version(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                missing.append(wanted_version)
                continue
            if not requirement.specifier.contains(version, prereleases=True):
                missing.append(f"{wanted_version} (found {version})")
    return sorted(set(missing))


def gather(root: Path, extra: str) -> Facts:
    facts = Facts(installed_version=None, source_version=source_version(root))
    try:
        dist = importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError:
        return facts
    facts.installed_version = dist.version
    facts.editable_from = editable_folder(dist)
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.origin:
        facts.imported_from = Path(spec.origin).resolve().parent
    prefix = Path(sys.prefix)
    built = prefix / LABEXTENSION
    facts.labextension = (built / "package.json").is_file() and any((built / "static").glob("remoteEntry.*.js"))
    facts.server_config = (prefix / SERVER_CONFIG).is_file()
    facts.missing = missing_requirements(dist, ["", extra])
    return facts


def main(argv: List[str], root: Path = ROOT) -> int:
    if len(argv) != 1:
        print("usage: check_install.py EXTRA  (the extra ./run installs: lab or test)", file=sys.stderr)
        return 2
    found = problem(gather(root, argv[0]), root, argv[0])
    if found:
        print(found)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
