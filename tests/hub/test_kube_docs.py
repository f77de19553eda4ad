"""docs/admin/kubernetes.md shows what works: each Kubernetes object on the page passes the strict API schema of
the versions the page names, each `hub.extraConfig` on it configures a real KubeSpawner whose pods (every profile
of the same values) pass them too, and the ResourceClaimTemplate it shows is the one the hub makes from the
values beside it."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import yaml
from traitlets.config import Config

from .kube_tools import DRA_VERSIONS, VERSIONS, build_pod, group, spawner_for, validate

pytestmark = pytest.mark.usefixtures("no_cluster")  # every test: KubeSpawner finds no cluster

PAGE = Path(__file__).resolve().parents[2] / "docs" / "admin" / "kubernetes.md"
FENCE = re.compile(r"^(?P<indent>[ ]*)```yaml[ ]*\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S)


def yaml_documents() -> list:
    """Every YAML document of the page's ```yaml blocks (indented ones, inside lists, too)."""
    found = []
    for match in FENCE.finditer(PAGE.read_text(encoding="utf-8")):
        body = textwrap.dedent(match.group("body"))
        found += [doc for doc in yaml.safe_load_all(body) if doc]
    return found


def objects() -> list:
    return [doc for doc in yaml_documents() if isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc]


def values() -> list:
    """The chart values on the page that call configure_kubespawner_gpu."""
    return [
        doc
        for doc in yaml_documents()
        if isinstance(doc, dict)
        and "configure_kubespawner_gpu" in "".join(doc.get("hub", {}).get("extraConfig", {}).values())
    ]


def way_of(chart_values: dict) -> str:
    found = re.search(r'way="([a-z-]+)"', "".join(chart_values["hub"]["extraConfig"].values()))
    return found.group(1) if found else "none"


def test_the_page_has_what_this_test_reads():
    kinds = sorted(doc["kind"] for doc in objects())
    assert kinds == ["ResourceClaimTemplate", "Role", "RoleBinding"]
    assert [way_of(v) for v in values()] == ["hami", "hami-dra", "kai", "nvidia-dra"]


@pytest.mark.parametrize("manifest", objects(), ids=lambda doc: doc["kind"])
def test_each_object_on_the_page_passes_the_api_schema(manifest):
    validate(manifest, DRA_VERSIONS if manifest["apiVersion"].startswith("resource.k8s.io/") else VERSIONS)


def configured(chart_values: dict, host: str) -> Config:
    c = Config()
    for snippet in chart_values["hub"]["extraConfig"].values():
        exec(snippet, {"c": c})  # as z2jh's hub runs hub.extraConfig: with `c` in scope
    c.KubeSpawner.k8s_api_host = host
    profiles = chart_values.get("singleuser", {}).get("profileList")
    if profiles:
        c.KubeSpawner.profile_list = profiles
    return c


@pytest.mark.parametrize("chart_values", values(), ids=way_of)
async def test_each_configuration_on_the_page_builds_pods_that_pass_the_schema(fake_api, chart_values):
    c = configured(chart_values, fake_api.host)
    assert callable(c.KubeSpawner.pre_spawn_hook) and callable(c.KubeSpawner.modify_pod_hook)
    mapping_groups = re.findall(r'"([a-z-]+)": \{', "".join(chart_values["hub"]["extraConfig"].values()))
    for groups in [[]] + [[name] for name in mapping_groups if name not in ("gpus",)]:
        await build_pod(spawner_for(c, "someone", [group(g) for g in groups]))  # build_pod checks the schema
    for profile in chart_values.get("singleuser", {}).get("profileList", []):
        if "slug" in profile:
            await build_pod(spawner_for(c, "someone"), profile["slug"])
    assert fake_api.problems == []


async def test_the_template_on_the_page_is_the_one_the_hub_makes(fake_api):
    (shown,) = [doc for doc in objects() if doc["kind"] == "ResourceClaimTemplate"]
    (hami_dra,) = [v for v in values() if way_of(v) == "hami-dra"]
    spawner = spawner_for(configured(hami_dra, fake_api.host), "someone", [group("staff")])
    spawner.namespace = shown["metadata"]["namespace"]
    await build_pod(spawner)
    (made,) = fake_api.templates.values()
    assert made == shown
