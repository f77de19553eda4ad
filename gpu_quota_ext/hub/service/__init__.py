"""The host service: one ledger for every user of a JupyterHub host (a JupyterHub service).

Its wire contract is gpu_quota_ext.shared.service_contract (user servers' RemoteLedger speaks it);
app.py wires the parts (its traits: settings_traits.py, from SERVICE_SETTINGS): book.py (every user's grants and
the servers' leases, pure), store.py (SQLite), expiry.py (leases that ran out), sampler.py + attribution.py (the
host watchdog, and the check of every PID a lease registers), limits.py (one user's share of the host, pure),
room.py (the host's broker: one view of every user's kernels for parking's decisions, pure), broker.py (the room
run: the sample, host memory, reservations on disk) and polls.py (the leases' long polls that carry its park
requests), auth.py (who calls, as the hub says), guard.py (per-user limits), handlers.py (the HTTP API) and
bodies.py (what its bodies may be), page.py and status.py (the admin's page), hub_directory.py, user_policy.py
and policies.py (what the hub says of each user), spec.py and configure.py (what jupyterhub_config.py calls).
"""
