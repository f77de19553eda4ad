"""The ledger: the one record of every kernel's grant (admission, placement, caps).

interface.py is what the rest of the server depends on (the `Ledger` Protocol, `Grant`, the errors);
local.py is a server's own ledger; remote.py asks the host service's ledger for a hub host.
"""

from .interface import (
    AdmissionRefused,
    ChangeOutcome,
    Grant,
    HeldGrants,
    Ledger,
    UnknownKernel,
)
from .local import LocalLedger
from .remote import RemoteLedger

__all__ = [
    "AdmissionRefused",
    "ChangeOutcome",
    "Grant",
    "HeldGrants",
    "Ledger",
    "UnknownKernel",
    "LocalLedger",
    "RemoteLedger",
]
