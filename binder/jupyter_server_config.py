# gpu-quota-ext: DEMO configuration, for mybinder.org and other machines WITHOUT a GPU.
#
# THIS IS A DEMO. There is no GPU here: the extension is given two simulated devices (a static
# inventory) so that its parts can be tried: the caps every kernel gets, `%gpucap`, the usage panel
# and the JupyterLab sidebar. Nothing is allocated on any GPU and no memory is really limited.
# On a machine with NVIDIA GPUs, do not use this file: the extension finds the real GPUs through NVML.
#
# binder/postBuild copies this file to `jupyter --config-dir`/jupyter_server_config.py.

c = get_config()  # noqa: F821 (defined by Jupyter when it loads this file)

c.ServerApp.jpserver_extensions = {"gpu_quota_ext": True}

# The simulated devices; their names say so in the sidebar, the status API and `%gpucap panel`.
c.GpuQuota.inventory_class = "gpu_quota_ext.devices.StaticInventory"
c.StaticInventory.devices = [
    {"name": "DEMO GPU 0 (simulated, no real GPU)", "total": "80GiB"},
    {"name": "DEMO GPU 1 (simulated, no real GPU)", "total": "40GiB"},
]

# What a small shared server might set: a quarter of a GPU per kernel, up to half on request,
# larger requests clamped to half (try `%gpucap 0.9` in examples/01-gpu-quota-tour.ipynb).
c.GpuQuota.default_cap = "0.25"
c.GpuQuota.max_cap = "0.5"
c.GpuQuota.on_over_max = "clamp"
