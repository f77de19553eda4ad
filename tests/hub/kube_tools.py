"""What the KubeSpawner tests share: real KubeSpawner objects building their pods the way JupyterHub and
KubeSpawner do before sending them, every object the hub would send checked against the real Kubernetes API
schema of each version the docs name, and a stand-in API server for what the hub does send (the
ResourceClaimTemplates of the DRA ways) that checks each body against the same schemas.

No cluster runs here. KubeSpawner builds its pod manifest without talking to Kubernetes; it only loads a client
configuration when it is created. The kubeconfig names an API server: nothing listens there for the ways that
send nothing but the pod (which these tests build and never send), and `fake_api` answers for the rest.
"""

from __future__ import annotations

import asyncio
import json
from typing import Dict, Iterator, List, Optional
from unittest.mock import Mock

import kubernetes_validate
from jupyterhub import orm
from jupyterhub.objects import Hub, Server
from jupyterhub.utils import maybe_future
from kubernetes_asyncio.config import kube_config
from kubespawner import KubeSpawner
from kubespawner import clients as kubespawner_clients
from tornado import httpserver, netutil, web

# The Kubernetes minor versions the docs name, and the schemas checked for each (kubernetes-validate ships the
# OpenAPI schemas of every release; the strict ones refuse a field the API does not have).
VERSIONS = ("1.33", "1.34", "1.35", "1.36")
# resource.k8s.io/v1 (ResourceClaimTemplate, DeviceClass) is served from 1.34: the DRA ways need it.
DRA_VERSIONS = ("1.34", "1.35", "1.36")

KUBECONFIG = """\
apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "https://127.0.0.1:9"}}]
contexts: [{name: none, context: {cluster: none, user: none}}]
current-context: none
users: [{name: none, user: {token: unused}}]
"""


def cluster_free(tmp_path, monkeypatch, jp_asyncio_loop) -> Iterator[None]:
    """KubeSpawner's clients read a kubeconfig of no cluster, for one test (conftest.py's `no_cluster`)."""
    path = tmp_path / "kubeconfig"
    path.write_text(KUBECONFIG)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: the kubeconfig is read
    # The client library reads $KUBECONFIG once, when imported: point its default there.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    # KubeSpawner loads the client configuration once per (host, ...): a test's own API host must be read anew.
    kubespawner_clients.load_config.cache_clear()
    yield
    kubespawner_clients.load_config.cache_clear()
    # KubeSpawner's shared API client waits in a task to close itself with the loop: end it here.
    pending = [task for task in asyncio.all_tasks(jp_asyncio_loop) if not task.done()]
    for task in pending:
        task.cancel()
    jp_asyncio_loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


class HubUser(Mock):
    """What KubeSpawner and the hook read of a jupyterhub.user.User: name, url, server, groups
    (real jupyterhub.orm.Group objects, with their properties)."""

    server = Server()

    def __init__(self, name: str, groups=()):
        super().__init__()
        self.name = name
        self.groups = list(groups)

    def _get_child_mock(self, **kwargs):
        return Mock(**kwargs)  # any other attribute: a plain Mock, not another HubUser

    @property
    def escaped_name(self):
        return self.name

    @property
    def url(self):
        return self.server.url


def group(name: str, **properties) -> orm.Group:
    return orm.Group(name=name, properties=properties)


def spawner_for(config, name: str, groups=()) -> KubeSpawner:
    return KubeSpawner(config=config, user=HubUser(name, groups), hub=Hub(), _mock=True)


def as_sent(spawner: KubeSpawner, pod) -> dict:
    """The pod as its JSON body would be sent (camelCase, no nulls)."""
    return spawner.api.api_client.sanitize_for_serialization(pod)


def validate(manifest: dict, versions=VERSIONS) -> None:
    """Check one object against the strict schema of each version; raises kubernetes_validate's error."""
    for version in versions:
        kubernetes_validate.validate(manifest, version, strict=True)


async def build_pod(spawner: KubeSpawner, profile: Optional[str] = None):
    """JupyterHub's and KubeSpawner's own steps up to the pod they would create (User.spawn: user_options,
    pre_spawn_hook; KubeSpawner._start: load_user_options, which applies the chosen profile, get_pod_manifest,
    modify_pod_hook); the pod is checked against every version's schema before it is returned."""
    spawner.user_options = {"profile": profile} if profile else {}
    if hasattr(spawner, "apply_group_overrides"):  # JupyterHub >= 5.3: c.Spawner.group_overrides
        await spawner.apply_group_overrides()
    await maybe_future(spawner.run_pre_spawn_hook())
    await spawner.load_user_options()
    pod = await spawner.get_pod_manifest()
    if spawner.modify_pod_hook:
        pod = await maybe_future(spawner.modify_pod_hook(spawner, pod))
    validate(as_sent(spawner, pod))
    return pod


def container(pod):
    return next(c for c in pod.spec.containers if c.name == "notebook")


def record_of(pod) -> dict:
    return json.loads(pod.metadata.annotations["gpu-quota-ext/pod-gpu"])


def kubelet_annotations_file(pod) -> str:
    """The annotations file the kubelet writes through the downward API: `key="value"` lines, sorted, each
    value quoted like Go's strconv.Quote (JSON's quoting is the same for these values)."""
    return "".join(f"{key}={json.dumps(value)}\n" for key, value in sorted((pod.metadata.annotations or {}).items()))


class FakeApi:
    """A stand-in for the API server's resourceclaimtemplates endpoint: keeps what it was sent after checking it
    against the schemas of DRA_VERSIONS, answers 409 for a name it has, or `status` when a test sets one."""

    def __init__(self):
        self.templates: Dict[str, dict] = {}
        self.posts: List[str] = []
        self.status: Optional[int] = None
        self.problems: List[str] = []

    def app(self) -> web.Application:
        api = self

        class Templates(web.RequestHandler):
            def post(self, namespace):
                body = json.loads(self.request.body)
                api.posts.append(f"{namespace}/{body['metadata']['name']}")
                if api.status is not None:
                    self.set_status(api.status)
                    self.finish({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": api.status})
                    return
                try:
                    validate(body, DRA_VERSIONS)
                except kubernetes_validate.ValidationError as error:
                    api.problems.append(str(error.message))
                    self.set_status(422)
                    self.finish({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 422})
                    return
                key = f"{namespace}/{body['metadata']['name']}"
                if key in api.templates:
                    self.set_status(409)
                    self.finish({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 409})
                    return
                api.templates[key] = body
                self.set_status(201)
                self.finish(body)

        return web.Application([(r"/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/resourceclaimtemplates", Templates)])


def serving_fake_api(jp_asyncio_loop) -> Iterator["FakeApi"]:
    """FakeApi listening on a free port of 127.0.0.1; `fake_api.host` is what c.KubeSpawner.k8s_api_host takes."""
    api = FakeApi()

    async def start():
        sockets = netutil.bind_sockets(0, "127.0.0.1")
        server = httpserver.HTTPServer(api.app())
        server.add_sockets(sockets)
        return server, sockets[0].getsockname()[1]

    server, port = jp_asyncio_loop.run_until_complete(start())
    api.host = f"http://127.0.0.1:{port}"
    yield api
    server.stop()
    jp_asyncio_loop.run_until_complete(server.close_all_connections())
