"""The hub side: what JupyterHub's config calls to give every user's server its caps.

caps.py: per-user and per-group caps carried to each user's server through its environment
(`configure_hub_caps`); kube/: the same mapping as each KubeSpawner pod's GPU share, through HAMi, HAMi-DRA,
KAI's fractions or NVIDIA's DRA driver (`configure_kubespawner_gpu`); service/: the host service, one ledger
for every user of a hub host (`configure_host_service`). Nothing here imports jupyterhub or kubespawner at import time.

    from gpu_quota_ext.hub import configure_hub_caps
"""

from .caps import (
    PROPERTY_KEY,
    HubCaps,
    HubGroup,
    caps_environment,
    choose_settings,
    configure_hub_caps,
    hub_caps,
)
from .kube import configure_kubespawner_gpu, kube_gpu
from .service.configure import configure_host_service

__all__ = [
    "PROPERTY_KEY", "HubCaps", "HubGroup", "caps_environment", "choose_settings", "configure_hub_caps", "hub_caps",
    "configure_kubespawner_gpu", "kube_gpu", "configure_host_service",
]
