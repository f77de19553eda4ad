"""The ledger: the one record of every kernel's grant (admission, placement, caps).

interface.py is what the rest of the server depends on (the `Ledger` Protocol and its reads alone, `GrantReads`;
`Grant`, the errors, and what a host service behind a ledger offers: `HostService`, `LeaseHooks`);
local.py is a server's own ledger; remote.py asks the host service's ledger for a hub host, through transport.py
(HTTP to the service) and lease.py (the renewals that keep its grants alive, and what the server tells them).
"""

from .interface import (
    AdmissionRefused,
    ChangeOutcome,
    Grant,
    GrantReads,
    HeldGrants,
    HostService,
    LeaseHooks,
    Ledger,
    UnknownKernel,
)
from .local import LocalLedger
from .remote import RemoteLedger

__all__ = [
    "AdmissionRefused",
    "ChangeOutcome",
    "Grant",
    "GrantReads",
    "HeldGrants",
    "HostService",
    "Ledger",
    "UnknownKernel",
    "LeaseHooks",
    "LocalLedger",
    "RemoteLedger",
]
