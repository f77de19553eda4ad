"""The REST API's contract: its routes, the kernel-secret header, the body fields and the status answer's fields.

One place for what the server (handlers.py), the kernel (kernel/client.py), the benchmarks and the
sidebar (labextension/src/contract.ts mirrors it; a test checks the names) must agree on. Standard library only.
Paths are relative to the server's base_url.
"""

from __future__ import annotations

from .park_state import ParkState

API_PREFIX = "/api/gpu-quota"
STATUS_PATH = API_PREFIX + "/status"  # GET: devices, kernels, policy, monitor (the sidebar's poll)
KERNELS_PATH = API_PREFIX + "/kernels"  # + "/<kernel id>": GET a grant, PUT a cap; + "/usage": POST a usage report
USAGE_SUFFIX = "usage"

# A kernel may read, change and report on itself with its own secret (GPU_QUOTA_KERNEL_TOKEN), sent here.
KERNEL_TOKEN_HEADER = "X-GPU-Quota-Kernel-Token"

MAX_BODY = 64 * 1024  # bytes: the largest request body any route reads (a usage report of 64 devices is ~6 KiB)
MAX_BODY_TEXT = "64 KiB"

# PUT kernels/<id>: {"cap": "0.3" | "30%" | "12GiB" | bytes, "device": optional server device index}, or {"reset": true}
CAP_REQUEST_FIELDS = ("cap", "device", "reset")
# POST kernels/<id>/usage: {"devices": [{"index": 0, "allocated": int, "reserved": int, "peak": int}]}
USAGE_REPORT_FIELDS = ("devices",)
USAGE_FIELDS = ("allocated", "reserved", "peak")  # per device of a usage report, next to "index"

# GET status: the answer's fields, at the top, per device, per kernel and per device of a kernel.
STATUS_FIELDS = (
    "gpu", "message", "user", "devices", "kernels", "policy", "monitor", "actions", "hard_cap", "reasons", "host_memory"
)
# "host_memory": parking's one account of the host's memory (parking/host_account.py, Parker.host_json)
HOST_MEMORY_FIELDS = (
    "available", "cgroup_room", "promised", "parked", "margin", "short", "short_since", "reason", "short_episodes"
)
STATUS_DEVICE_FIELDS = ("index", "name", "uuid", "total", "budget", "granted", "kernels", "used", "share")
# A device's "share": null for a whole GPU; inside a pod the cluster gave part of it, where that came from:
# way ("hami", "hami-dra", "kai", "nvidia-dra"), bytes (= the device's total), source (the variable or annotation
# read), enforced_by (the layer that holds the pod to it, or null: nothing does), scope ("pod": all its processes
# together; "process": each process alone, as an MPS limit).
DEVICE_SHARE_FIELDS = ("way", "bytes", "source", "enforced_by", "scope")
KERNEL_FIELDS = (
    "id", "user", "kernelspec", "source", "placed", "cpu_only_reason", "devices", "path", "last_action", "layers",
    "park",  # PARK_FIELDS below (the parker's, through the status view's add_kernel_field)
    "reasons",  # KERNEL_REASONS below
)
KERNEL_DEVICE_FIELDS = (
    "index", "cap", "max_cap", "policy_cap", "used", "allocated", "reserved", "peak", "reported_at",
)


# --- reasons in plain words ------------------------------------------------------------------------
# Where the answer carries a raw reason (a driver's error text), a "reasons" object carries it again as a
# pair: {"reason": a few plain words (shared/reasons.py), "detail": the raw text}, or null when there is
# nothing to explain. The raw fields stay as they are.
REASON_FIELDS = ("reason", "detail")
STATUS_REASONS = (  # the answer's "reasons"
    "no_gpu",  # the top-level "message": why the server has no GPU
    "monitor",  # "monitor"."message": what keeps the monitor from measuring
)
KERNEL_REASONS = (  # each kernel's "reasons"
    "cpu_only",  # "cpu_only_reason": why the kernel holds no GPU
    "park",  # "park"."reason": why not parkable, why it did not park, what a waiting resume waits for
    "hard_limit",  # "layers"."hard_reason": why the driver enforces no hard limit for it
)


def kernel_path(kernel_id: str, *parts: str) -> str:
    """kernels/<id>[/parts], under API_PREFIX (the caller quotes the id when it builds a URL)."""
    return "/".join((KERNELS_PATH, kernel_id) + parts)

# --- parking (idle kernels' GPU memory moved to host memory and back) -----------------------------
# POST kernels/<id>/park: park once the current cell has finished (202, answer: {"park": PARK_FIELDS});
# POST kernels/<id>/resume: bring it back now (202, same answer). Same authorization as the other
# kernel routes: the server's user, or the kernel itself with its own secret.
PARK_SUFFIX = "park"
RESUME_SUFFIX = "resume"
# POST kernels/<id>/room {"device": index | null}: the kernel's allocation found the GPU itself full; with
# park_on_device_full "on" the broker parks idle kernels to give it room up to its cap (202, {"park": ...}, whose
# "room" then says how it goes); 409 {"park", "message"} when it is off, or nothing is left to give. Same
# authorization as the park route.
ROOM_SUFFIX = "room"
# The server's requests to a kernel, on its control channel (kernel/park_wait.py answers them): content
# {"action": "trim"} before a park (empty the allocators' caches; the kernel may be parked from now on) ->
# {"freed": bytes, "reserved_before": bytes, "reserved_after": bytes, "frameworks": [...]}; {"action": "lost", "at":
# wall clock, "words": text} after a restart that lost it (parking/lost.py) -> {"shown": bool}. With fast_park on
# (kernel/fast_park.py answers): {"action": "facts"} -> kernel/fast_park.FACTS; {"action": "park", "arena": bytes,
# "timeout": s} and {"action": "resume", "keep_arena": bool, "timeout": s} -> {"code": 0 or the library's or the
# driver's code, "message", "seconds", "bytes"} (parking/pages_driver.py asks them). The types are
# untracked by jupyter_server's activity monitor: they are not the user's activity.
KERNEL_REQUEST = "gpu_quota_request"
KERNEL_REPLY = "gpu_quota_reply"
# A kernel's park state, in the status answer (each kernel's "park") and in the park/resume answers: the words of
# park_state.ParkState (what each means is said there), in its order.
PARK_STATES = tuple(state.value for state in ParkState)
PARK_FIELDS = (
    "state",  # one of PARK_STATES
    "since",  # wall clock (seconds) the state began
    "idle_seconds",  # seconds since jupyter_server last saw the kernel active, or null
    "host_bytes",  # bytes the driver holds on the host for it while parked, or null
    "parkable",  # false: parking cannot work for it (no checkpoint driver, MPS client, another user, no GPU)
    "reason",  # why not parkable, why it did not park, or what a waiting resume waits for; null if none
    "waited",  # seconds it has waited for room (waiting), or null
    "wait_limit",  # seconds a cell waits for room before it is told (park_wait_limit), or null: no limit
    "told",  # true once its wait passed the limit: the cell that waits ends with `reason`, the kernel stays parked
    "room",  # a running kernel that asked for room (POST room): "asking", then "made" or "told"; null if none
    "lost",  # restarted after its process ended while parked: {"at", "why", "words"} until its next cell said it
    "path",  # fast_park on: how its current or last park goes, PARK_PATH_FIELDS; null before one, or fast_park off
)
PARK_PATHS = ("pages", "checkpoint")  # the fast park library's copy, or the driver's checkpoint calls
PARK_PATH_FIELDS = (
    "path",  # one of PARK_PATHS (parking/path.py chooses per kernel, at each park)
    "reason",  # why this path, in words
    "stays_on_device",  # bytes a park leaves on the device (pages: its CUDA context), counted as still held there
    "park_seconds",  # pages: the library's copy to the host, as the kernel timed it; null otherwise
    "resume_seconds",  # pages: its copy back; null until a resume
    "resume_waited_seconds",  # pages: of resume_seconds, the wait for a park under way to free its room (a swap)
)

# --- usage history (each kernel's usage over the last minutes, for the sidebar's and the panel's charts) ----
# GET history?since=T: {"interval": seconds between points, "points_max": N, "kernels": {kernel id: [POINT]}},
#   every kernel the server keeps a history for (a list, maybe empty); only points with t > T, all kept
#   points without `since`. The server's user only.
# GET kernels/<id>/history?since=T: {"interval", "points_max", "points": [POINT]}; the server's user, or
#   the kernel itself with its own secret.
HISTORY_PATH = API_PREFIX + "/history"
HISTORY_SUFFIX = "history"
HISTORY_SINCE = "since"  # the query argument: wall-clock seconds
HISTORY_FIELDS = ("interval", "points_max", "kernels")
KERNEL_HISTORY_FIELDS = ("interval", "points_max", "points")
HISTORY_POINT_FIELDS = (
    "t",  # wall clock (seconds) when the monitor's sample came in
    "used",  # NVML, the kernel's processes summed over its devices; null: unknown
    "allocated",  # the kernel's last allocator report, summed over its devices; null: none
    "reserved",  # the same, reserved
    "cap",  # the sum of its caps (the ledger's)
    "hard_limit",  # the sum of its hard limits (MPS, with the CUDA context); null: none
    "park",  # one of PARK_STATES
)
