"""The documentation site (docs/, Sphinx + MyST) builds with warnings as errors, into a temporary folder only,
and its generated reference shows every setting, route and metric the code has."""

import os
import subprocess
import sys
from html import escape
from pathlib import Path

import pytest

from gpu_quota_ext.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import gpu_quota_docs  # noqa: E402  (docs/_ext is not a package)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("docs")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")  # nothing written beside the sources
    built = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(ROOT / "docs"), str(out / "html")],
        capture_output=True, text=True, timeout=280, env=env, cwd=out,
    )
    assert built.returncode == 0, f"sphinx-build failed or warned:\n{built.stderr}{built.stdout}"
    return out / "html"


def page(site: Path, name: str) -> str:
    return (site / f"{name}.html").read_text(encoding="utf-8")


def test_the_site_builds_without_a_warning_and_has_every_page(site):
    sources = {p.relative_to(ROOT / "docs").with_suffix("").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    sources = {s for s in sources if not s.startswith("_")}
    built = {p.relative_to(site).with_suffix("").as_posix() for p in site.rglob("*.html")}
    assert sources <= built
    assert "_images/sidebar-light.png" in page(site, "index")


def test_the_settings_reference_has_every_setting_with_its_variable_and_default(site):
    html = page(site, "reference/settings")
    rows = gpu_quota_docs.setting_rows(SETTINGS)
    assert [name for name, *_ in rows] == list(SETTINGS)
    for name, env, default, _ in rows:
        start = html.index(f'id="setting-{name}"')
        row = html[start:html.index("</tr>", start)]
        assert (env or "–") in row, name
        assert escape(default) in row, name
        assert (env, default) == (SETTINGS[name].env or "", gpu_quota_docs.written(SETTINGS[name].default))


def test_the_rest_reference_lists_every_route_the_server_serves(site):
    html = page(site, "reference/rest-api")
    routes = gpu_quota_docs.route_rows(gpu_quota_docs.module("app").GpuQuota)
    assert len(routes) >= 5
    for method, path in routes:
        assert path.replace("<", "&lt;").replace(">", "&gt;") in html, (method, path)


def test_the_metrics_reference_names_every_family_the_collectors_build(site):
    html = page(site, "reference/metrics")
    families = gpu_quota_docs.server_metric_rows() + gpu_quota_docs.service_metric_rows()
    assert any(name == "gpu_quota_kernel_park_state" for name, *_ in families)
    for name, *_ in families:
        assert name in html, name


def test_no_page_tells_to_install_from_pypi_or_has_a_placeholder_url():
    for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        text = path.read_text(encoding="utf-8")
        assert "pip install gpu-quota-ext" not in text, path
        assert "<owner>" not in text, path
