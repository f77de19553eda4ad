"""Code that runs INSIDE kernels.

Standard library only at import time, and never `import torch` eagerly: a kernel that never touches the
GPU must pay nothing (no CUDA context, no device memory, no import time). From the server side it imports
only `gpu_quota_ext.shared` (tests/unit/test_imports.py keeps it so). One module applies caps to torch
(torch_cap.py); one record holds the kernel's caps (state.KernelCapState, written by `write_caps` only).
"""
