"""JupyterHub on Kubernetes: each user's pod gets its GPUs and its share of their memory from the same mapping
(and group properties) that gives the user's server its caps, through the way the cluster shares GPUs.

In the hub's configuration (zero-to-jupyterhub: `hub.extraConfig`):

    from gpu_quota_ext.hub.kube import configure_kubespawner_gpu

    configure_kubespawner_gpu(
        c,
        way="hami",   # or "hami-dra", "kai", "nvidia-dra"
        default={"gpus": 1, "gpu_memory": "10GiB", "default_cap": "0.5", "max_cap": "1.0"},
        groups={"staff": {"gpu_memory": "40GiB"}, "no-gpu": {"gpus": 0}},
        users={"alice": {"gpu_memory": "50%", "gpu_type": "H200"}},
    )

Besides the server's keys (gpu_quota_ext.hub: default_cap, max_cap, ...), an entry may set the pod's:
- `gpus`: GPUs in the pod; 0 means no GPU at all;
- `gpu_memory`: the pod's memory on each of its GPUs: a size ("10GiB", whole MiB, rounded down) or a fraction
  ("0.25", "25%", whole percents; not for the DRA ways, whose claims ask in bytes);
- `gpu_cores`: percent of each GPU's compute (HAMi, HAMi-DRA's `cores`, NVIDIA MPS's active thread percentage);
- `gpu_type`: GPU models the pod may get (HAMi's `nvidia.com/use-gputype`; a CEL selector for DRA);
- `gpu_scheduler_policy`, `node_scheduler_policy`: "binpack" or "spread" (HAMi's scheduler only);
- `kai_queue`: the KAI queue of the user's pod (the `kai` way, where every pod needs one).
Each key comes from the user's entry, else their first group with settings, else `default`, as for caps.

The ways (one module each, over the vocabulary they share, hami.py): `hami` (hami.py: HAMi's device plugin
resources), `hami-dra` and `nvidia-dra` (dra.py: a ResourceClaimTemplate the hub creates, named in the pod),
`kai` (kai.py: KAI's scheduler, queue label and fraction annotations). keys.py holds the mapping's pod keys and
which way reads which; pod.py the edits on KubeSpawner's pod (merged, never replacing its CPU and memory
limits); spawner.py the two KubeSpawner hooks and the template's creation through KubeSpawner's API client.
Who wins against KubeSpawner's own settings (spawner-wide values, profiles, respawns) is said in spawner.py
and in the docs (Kubernetes). Nothing here imports jupyterhub or kubespawner; kubernetes_asyncio's models are
imported when a pod is edited.
"""

from .hami import HamiResources, PodGpu, SettledGpu, align_requests, merge_limits, pod_gpu, settle_limits, settled_gpu
from .keys import MAX_GPUS, POD_KEYS, WAY_KEYS
from .spawner import WAYS, ClaimTemplateError, KubeGpu, configure_kubespawner_gpu, kube_gpu

__all__ = [
    "HamiResources", "PodGpu", "SettledGpu", "align_requests", "merge_limits", "pod_gpu", "settle_limits",
    "settled_gpu", "MAX_GPUS", "POD_KEYS", "WAY_KEYS", "WAYS", "ClaimTemplateError", "KubeGpu",
    "configure_kubespawner_gpu", "kube_gpu",
]
