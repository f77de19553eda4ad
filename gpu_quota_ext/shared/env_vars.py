"""Names of the environment variables both sides use: the ones the launch hook writes and the kernel reads,
and the ones the hub sets for a user's server and for the host service. Standard library only."""

# --- written by the launch hook, read inside the kernel -----------------------------------------------
KERNEL_ID = "GPU_QUOTA_KERNEL_ID"
DEVICES = "GPU_QUOTA_DEVICES"  # JSON list: {"ordinal", "index", "uuid", "cap", "max_cap", "total"}
API_URL = "GPU_QUOTA_API_URL"  # where the kernel asks the server for a new cap
TOKEN = "GPU_QUOTA_KERNEL_TOKEN"  # the kernel's own secret: never logged, never written to a file
USER_STARTUP = "GPU_QUOTA_USER_PYTHONSTARTUP"  # the user's PYTHONSTARTUP, run after ours
CAP_SOURCE = "GPU_QUOTA_CAP_SOURCE"  # who set the caps in force: "default", "rule 0 (user=alice)", "kernel request"
CPU_ONLY_REASON = "GPU_QUOTA_CPU_ONLY_REASON"  # set when on_full="cpu-only" hid the GPUs
LAYERS = "GPU_QUOTA_LAYERS"  # JSON: the hard limit (MPS) the kernel started with, or why it has none
LOST = "GPU_QUOTA_LOST"  # JSON {"at", "words"}: a restart after its process ended while parked (parking/lost.py)
# Every one of them is the launch hook's alone: a kernel gets one only when the hook wrote it for that kernel,
# never from the server's own environment (a server started inside a kernel, or given anything).
KERNEL_SIDE = (KERNEL_ID, DEVICES, API_URL, TOKEN, USER_STARTUP, CAP_SOURCE, CPU_ONLY_REASON, LAYERS, LOST)

# --- set by the hub ---------------------------------------------------------------------------------
# In a user server's environment: the host service's URL. Set, the server's ledger is a RemoteLedger.
SERVICE_URL = "GPU_QUOTA_SERVICE_URL"
# In the host service's environment: the caps mapping as JSON ({"users": ..., "groups": ..., "default": ...}).
SERVICE_CAPS = "GPU_QUOTA_SERVICE_CAPS"
