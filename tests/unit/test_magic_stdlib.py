"""Kernel-side modules import only the standard library: they are also loaded inside kernels of other
Python environments, and a kernel that never uses the GPU must not pay for torch or widgets."""

from __future__ import annotations

import subprocess
import sys

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"IPython", "ipywidgets", "ipykernel", "torch", "traitlets", "tornado",
                                  "jupyter_server", "jupyter_client", "numpy", "comm"}:
            raise ImportError("blocked for this test: " + name)
sys.meta_path.insert(0, Block())
import gpu_quota_ext.kernel.magic, gpu_quota_ext.kernel.panel, gpu_quota_ext.kernel.oom
import gpu_quota_ext.kernel.client, gpu_quota_ext.kernel.usage, gpu_quota_ext.kernel.cells
import gpu_quota_ext.kernel.command, gpu_quota_ext.kernel.bootstrap
from gpu_quota_ext.kernel.panel import GpuUsagePanel
print("ok")
"""


def test_kernel_modules_import_with_nothing_but_the_stdlib():
    result = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
