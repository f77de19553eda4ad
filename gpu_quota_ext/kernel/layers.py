"""What `%gpucap` says about this kernel's layers: the soft cap, and the hard limit (NVIDIA MPS) or why
there is none. Read from GPU_QUOTA_LAYERS, which the launch hook sets when the server's hard_cap is on.

Stdlib only (runs inside kernels). A hard limit is fixed for the life of the process: the driver reads it
when CUDA starts, so a cap raised above it takes effect only after a restart.
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Optional

from ..shared.env_vars import LAYERS
from ..shared.sizes import format_bytes


def read_layers(env: Optional[Mapping[str, str]] = None) -> Optional[dict]:
    """The launch hook's record, or None when it set none (the server's hard_cap is off)."""
    text = (os.environ if env is None else env).get(LAYERS)
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return {"hard": None, "reason": f"unreadable {LAYERS}", "devices": []}
    return data if isinstance(data, dict) else {"hard": None, "reason": f"unreadable {LAYERS}", "devices": []}


def _usable_by_ordinal(data: dict) -> dict:
    return {int(d["ordinal"]): int(d["usable"]) for d in data.get("devices") or [] if "ordinal" in d and "usable" in d}


def layer_line(state, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """One line for `%gpucap`: soft cap only (and why), or soft cap + hard limit (MPS)."""
    if not state.managed or not state.devices:
        return None
    data = read_layers(env)
    if data is None:
        return (
            "layers: soft cap only (this server's hard limit, c.GpuQuota.hard_cap, is off); the server's watchdog "
            "watches the rest"
        )
    usable = _usable_by_ordinal(data)
    if data.get("hard") == "mps" and usable:
        where = ", ".join(f"{format_bytes(b)} on cuda:{o}" for o, b in sorted(usable.items()))
        return (
            f"layers: soft cap + hard limit (NVIDIA MPS): the driver refuses any allocation past {where} "
            "(plus the CUDA context), whatever library makes it"
        )
    return f"layers: soft cap only, no hard limit: {data.get('reason') or 'the server gave no reason'}"


def restart_note(state, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """After a cap change: where a cap in force is above the hard limit, the rest waits for a restart."""
    data = read_layers(env)
    if not data or data.get("hard") != "mps":
        return None
    usable = _usable_by_ordinal(data)
    above = [
        d for d in sorted(state.devices, key=lambda d: d.ordinal) if d.ordinal in usable and d.cap > usable[d.ordinal]
    ]
    if not above:
        return None
    where = ", ".join(f"{format_bytes(usable[d.ordinal])} on cuda:{d.ordinal}" for d in above)
    return (
        f"the hard limit (MPS) of this process stays {where}: the driver fixed it when CUDA started, "
        "so the raise above it takes effect at the next restart (Kernel > Restart Kernel)"
    )
