"""Code that runs INSIDE kernels.

Standard library only at import time, and never `import torch` eagerly: a kernel that never touches the
GPU must pay nothing (no CUDA context, no device memory, no import time).
"""
