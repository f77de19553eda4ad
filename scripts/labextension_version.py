"""Copy the package's version (gpu_quota_ext.__version__, the one source) into labextension/package.json.

The release workflow runs this after `hatch version` (pyproject's [tool.jupyter-releaser.hooks]), so that
`jupyter labextension list` shows the version pip shows. npm spells pre-releases its own way (semver):
0.2.0a1 is 0.2.0-alpha.1 there, 0.2.0rc1 is 0.2.0-rc.1, 0.2.0.dev3 is 0.2.0-dev.3.

    python scripts/labextension_version.py           write package.json's version
    python scripts/labextension_version.py --check   exit 1 (and say which) when the two differ
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION_FILE = Path("gpu_quota_ext", "__init__.py")
PACKAGE_JSON = Path("labextension", "package.json")

# The version forms a release of this package uses; anything else (post releases, local versions, epochs)
# has no npm spelling here and is refused rather than guessed.
_PEP440 = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:(a|b|rc)(\d+))?(?:\.dev(\d+))?$")
_NPM_PRERELEASE = {"a": "alpha", "b": "beta", "rc": "rc"}


def package_version(text: str) -> str:
    """The version string of `__version__ = "..."`, as hatch's regex source reads it."""
    match = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", text, re.MULTILINE)
    if not match:
        raise ValueError(f"no __version__ = '...' line in {VERSION_FILE.name}")
    return match.group(1)


def npm_version(version: str) -> str:
    """The semver spelling of a PEP 440 release, pre-release or dev release: 0.2.0a1 -> 0.2.0-alpha.1."""
    match = _PEP440.match(version)
    if not match:
        raise ValueError(f"{version!r} is not MAJOR.MINOR.PATCH[a|b|rcN][.devN]: no npm spelling for it")
    major, minor, patch, pre, pre_number, dev = match.groups()
    semver = f"{major}.{minor}.{patch}"
    labels = []
    if pre:
        labels.append(f"{_NPM_PRERELEASE[pre]}.{pre_number}")
    if dev is not None:
        labels.append(f"dev.{dev}")
    return semver + ("-" + ".".join(labels) if labels else "")


def main(argv: list[str], root: Path = ROOT) -> int:
    wanted = npm_version(package_version((root / VERSION_FILE).read_text(encoding="utf-8")))
    manifest_file = root / PACKAGE_JSON
    manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    if "--check" in argv:
        if manifest.get("version") != wanted:
            print(f"{PACKAGE_JSON} says {manifest.get('version')!r}; the package is {wanted!r}")
            return 1
        return 0
    manifest["version"] = wanted
    manifest_file.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{PACKAGE_JSON}: version {wanted}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
