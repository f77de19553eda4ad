"""Names of the environment variables the launch hook writes and the kernel reads. Standard library only."""

KERNEL_ID = "GPU_QUOTA_KERNEL_ID"
DEVICES = "GPU_QUOTA_DEVICES"  # JSON list: {"ordinal", "index", "uuid", "cap", "max_cap", "total"}
API_URL = "GPU_QUOTA_API_URL"  # where the kernel asks the server for a new cap
TOKEN = "GPU_QUOTA_KERNEL_TOKEN"  # the kernel's own secret: never logged, never written to a file
USER_STARTUP = "GPU_QUOTA_USER_PYTHONSTARTUP"  # the user's PYTHONSTARTUP, run after ours
CAP_SOURCE = "GPU_QUOTA_CAP_SOURCE"  # who set the caps in force: "default", "rule 0 (user=alice)", "kernel request"
CPU_ONLY_REASON = "GPU_QUOTA_CPU_ONLY_REASON"  # set when on_full="cpu-only" hid the GPUs
LAYERS = "GPU_QUOTA_LAYERS"  # JSON: the hard limit (MPS) the kernel started with, or why it has none
