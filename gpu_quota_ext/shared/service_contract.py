"""The wire contract between user servers and the host's quota service (a JupyterHub service).

The service holds the one ledger of the host. A user server's ledger (RemoteLedger) asks it for every
grant, change, reset and release; the service learns the user from the hub (the token's owner), never
from the request body. Paths are relative to the service's prefix (JUPYTERHUB_SERVICE_PREFIX, e.g.
"/services/gpu-quota/"), reached through the hub's proxy or directly at the service's URL.

Authentication: every API call carries `Authorization: token <the user server's JUPYTERHUB_API_TOKEN>`.
The service asks the hub who owns the token (HubAuth); the owner is the user the grant is for. The token must
have been given access to the service (`access:services!service=<its name>`, as JupyterHub services check):
any other is a 403, whoever owns it.
Admins (hub admin, or the ADMIN_SCOPE custom scope) see every user; everyone else sees their own only.

Devices are named by UUID on the wire: a user server and the service may number them differently.
"""

from __future__ import annotations

SERVICE_NAME = "gpu-quota"  # the default name in c.JupyterHub.services
API = "api/"
# POST: {"server": str, "kernel_id": str, "kernelspec": str, "allowed": [uuid, ...] | null}
#   201 {"grant": GRANT}   403 not yours   409 {"message": str} refused (budget full, on_full="refuse"; the
#   user's max_kernels or user_budget)
#   A kernel id the same server holds already (a restart) gets its grant back, 200. A request whose caller has
#   closed its connection before the service acts on it (a POST here, a PUT below) changes nothing: 499.
GRANTS_PATH = API + "grants"
# + "/<kernel id>": GET {"grant": GRANT}; PUT {"cap": ..., "device": uuid | null} or {"reset": true}
#   -> {"status": "granted" | "clamped" | "refused", "message": str, "grant": GRANT}; DELETE -> 204.
# POST {"server": str, "kernels": [{"kernel_id": str, "pids": [int, ...]}]}: the server's lease, renewed
#   every LEASE_RENEW seconds; it lists every kernel the server runs (re-registration after a service
#   restart). Grants of kernels not listed, and of servers whose lease ran out, are released. The PIDs are
#   checked by the service (a PID counts only while its real uid is the user's Unix user).
#   -> {"lease_seconds": int, "released": [kernel id, ...]}
#   The body may also carry "park": [KERNEL_PARK] (its kernels' park states, for the host's broker; entries of
#   kernels that are not the user's own on this server are ignored, as in "kernels") and "wait": seconds (0 to
#   LEASE_RENEW, else 400): the service records the lease at once, then answers as soon as it has kernels of this
#   server for it to park, or after `wait` seconds, a quarter of its lease at most (a long poll: a park for
#   another user's kernel reaches this server in well under a second). The answer then has "park": [kernel id,
#   ...] too: each asked once; the server renews again at once after an early answer. A service without the
#   host's broker answers such a body 400: the server renews without them from then on.
LEASE_PATH = API + "lease"
# POST {"server": str, "park": [KERNEL_PARK], "demands": [{"kernel_id": str, "need": {uuid: bytes}}]}: the host's
#   broker (one for every user of the host) decides for this server's kernels that wait for room: a server with
#   a kernel waiting asks at every sample, naming all of its waiting kernels (one it no longer names has ended).
#   Every kernel named must be the user's own and granted to this server (403 otherwise, nothing kept); every
#   device a need names must be one of the host's (400); a need above the kernel's cap there plus
#   CONTEXT_ALLOWANCE, and above the most the service's samples saw it hold there, is cut to the larger; a
#   demand of a kernel the service's sample shows on the device waits (a resume is a parked kernel's); a demand's
#   age is the service's own (since it first saw it), not the server's word; a kernel the service holds no grant
#   for is answered in "waiting" (released). At most
#   4096 entries in each list (400).
#   -> 200 {"go": [kernel id], "park": [kernel id], "waiting": {kernel id: reason}, "told": {kernel id: message},
#   "freeing": {kernel id: {uuid: bytes}}}
#   "go": room is reserved for its restore now (until the service's sample shows its memory back, or a timeout;
#   asked again meanwhile, it is "go" again on the same room); "park": this server's idle kernels to park (for
#   its own demand or another user's); "told": the demand waited the host's park_wait_limit. Reasons name another
#   user's kernel only as "of another user".
#   With "host_park": {"kernel_id": str, "bytes": int} (a park of this server's about to begin), the answer also
#   has "host_park": {"kernel_id": str, "refused": null | why}: null promises the park its host memory (at least
#   what the service's last sample saw the kernel hold) until its server reports it parked or running again; the
#   server asks the driver only then. Servers older than this never send it; services older than this answer 400.
#   A demand may say "may_wait": true (absent: false; not a bool: 400): its resume goes through the fast path,
#   which waits, bounded (SWAP_WAIT), for memory being freed and fails recoverably (the kernel stays parked).
#   Believed only of a kernel whose server's last report gave "stays" above 0 (state parked or waiting). Such a
#   demand may get "go" while the parks making its room still copy (a swap, where they release as they copy); the
#   answer then has, for each such new "go", "freeing": {kernel id: {uuid: bytes}}: what of its need those parks
#   are still freeing (its restore waits for it), and its room is held SWAP_WAIT longer than another go's.
#   "freeing" is always in the answer ({} when none); a "go" repeated on a swap's reservation (its answer was
#   lost) says the same bytes again. Older servers ignore it.
# KERNEL_PARK: {"kernel_id": str, "state": a park state, "idle_for": seconds | null, "parkable": bool, and for a
#   kernel the fast park parked "stays": bytes its park left on the device (its CUDA context; 0 to CONTEXT_ALLOWANCE)
#   while the state is parked or waiting: the service does not take those bytes for a park still under way; and
#   for a kernel in state "parking" whose fast-path park gives each piece back as it is copied,
#   "releases_as_copied": true (absent: false; not a bool: 400; ignored with any other state)}
#   A server sends "may_wait" and "releases_as_copied" only when true, so only a server with fast_park on sends
#   them: a service older than this (which refuses unknown keys, 400) sees them from no other server.
ROOM_PATH = API + "room"
CONTEXT_ALLOWANCE = 2 << 30  # beyond its cap, what a parked kernel may have held (its CUDA context, rounding)
MAX_BYTES = 1 << 60  # beyond any device's memory: a byte count on this wire above it is not one
# The most a fast resume waits inside its kernel for memory that parks under way are freeing (a swap; the parker's
# comment says why 60 s). The host service holds a swap's reservation this much longer than any other's: the
# resume may still be taking its memory when the copy alone would have ended.
SWAP_WAIT = 60.0
# GET: users, kernels (with their park states as last reported), devices, caps, usage, unmanaged usage, last
# actions; the host's broker's waiting kernels, reservations and park requests (admins: and its long polls)
STATUS_PATH = API + "status"
METRICS_PATH = "metrics"  # Prometheus, per user and kernel (admin scope)
ADMIN_PAGE = ""  # the admin's page, behind hub OAuth

LEASE_SECONDS = 60  # a server not heard of for this long has stopped or crashed: its grants go
LEASE_RENEW = 15  # seconds between a server's lease renewals
CALL_TIMEOUT = 5.0  # seconds a user server waits for one answer
START_RETRIES = 3  # a kernel start retries this often (1 s apart) before it is refused: "quota service unreachable"

ADMIN_SCOPE = "custom:gpu-quota:admin"  # sees and acts on every user's kernels

# GRANT on the wire: Grant.to_json() of the service's ledger with each device's "uuid" added;
# the user server maps uuids to its own device indexes.
