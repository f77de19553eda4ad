"""The status view: what the REST API and /metrics show, built in one place from the parts that know.

Caps come from the ledger, measured usage from the monitor's last sample (unknown while it is stalled),
the kernels' own allocator figures from their reports, actions from the watchdog, layers from the
hard-limit layer. The handlers only parse, authorize and call this; the Prometheus collector calls
`metric_families` at scrape time (the only families of the server: the hard limits and park states
included). Other parts add fields to each kernel's entry through
`add_kernel_field` (parking adds "park"), so the view stays the one place that builds the answer.
Where the answer carries a raw reason, its "reasons" say it again in plain words (shared/reasons.py).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Tuple

from ..ledger import Grant, Ledger
from ..policy import Policy
from ..shared.reasons import reason_pair
from ..usage import KernelIds, KernelReports, Monitor, Watchdog, WatchdogSettings
from .collector import hard_limit_family, monitor_families

log = logging.getLogger("gpu_quota_ext")

SERVER_FIELDS = ("host_memory",)  # the answer's fields that parts add (add_server_field)

KernelField = Callable[[str], Any]  # kernel id -> a JSON-able value
FieldFamilies = Callable[[Mapping[str, Any]], List[Any]]  # kernel id -> the field's value: its /metrics families

# The fields `kernel` writes itself (all in the contract's KERNEL_FIELDS); others come from add_kernel_field.
VIEW_FIELDS = (
    "id",
    "user",
    "kernelspec",
    "source",
    "placed",
    "cpu_only_reason",
    "devices",
    "path",
    "last_action",
    "layers",
    "reasons",
)


class HardLimitShown(Protocol):
    """The hard-limit layer (hard_limit.HardLimitLayer) as the view shows it."""

    def describe(self) -> dict: ...

    def kernel_json(self, grant: Grant) -> dict: ...

    def limits(self) -> Dict[str, Dict[int, int]]: ...


class StatusView:
    def __init__(
        self,
        *,
        policy: Policy,
        settings: WatchdogSettings,
        user: str,
        no_gpu_reason: Optional[str],
        ledger: Ledger,
        monitor: Monitor,
        reports: KernelReports,
        watchdog: Watchdog,
        hard_cap: HardLimitShown,
        kernels: KernelIds,
    ):
        self.policy = policy
        self.settings = settings
        self.user = user
        self.no_gpu_reason = no_gpu_reason
        self.ledger = ledger
        self.monitor = monitor
        self.reports = reports
        self.watchdog = watchdog
        self.hard_cap = hard_cap
        self.kernels = kernels
        self._fields: Dict[str, Tuple[KernelField, Optional[FieldFamilies]]] = {}
        self._server_fields: Dict[str, Tuple[Callable[[], Any], Optional[Callable[[Any], List[Any]]]]] = {}

    def add_kernel_field(self, name: str, value: KernelField, families: Optional[FieldFamilies] = None) -> None:
        """Every kernel's entry gets `name: value(kernel_id)` (JSON-able); with `families`, /metrics gets
        `families({kernel id: value})` for every kernel the server runs. A name the view already writes, or
        one added before, is refused: two parts must not write the same field."""
        if name in self._fields or name in VIEW_FIELDS:
            raise ValueError(f"the status view's kernels already have a field {name!r}")
        self._fields[name] = (value, families)

    def add_server_field(
        self, name: str, value: Callable[[], Any], families: Optional[Callable[[Any], List[Any]]] = None
    ) -> None:
        """The answer gets `name: value()` (JSON-able); with `families`, /metrics gets `families(value())`. Such a
        field is in the contract's STATUS_FIELDS; until a part adds it, the answer says null."""
        if name in self._server_fields:
            raise ValueError(f"the status answer already has a field {name!r} from a part")
        self._server_fields[name] = (value, families)

    # --- the REST API -------------------------------------------------------------------------------

    def answer(self, paths: Mapping[str, Optional[str]]) -> dict:
        """GET /api/gpu-quota/status. `paths`: kernel id -> notebook path (the session manager's)."""
        devices = self.ledger.device_grants()
        # A device whose total is a pod's share (devices.share.DeviceShare) says where the share came from.
        shares = {d.index: d.share.to_json() if d.share is not None else None for d in self.ledger.devices}
        for device in devices:
            device["used"] = self.monitor.device_used(device["index"])
            device["share"] = shares.get(device["index"])
        # Under the host's quota service this server's own policy settings are ignored: say who decides instead.
        decided_by = self.ledger.decided_by()
        policy = self.policy.describe() if decided_by is None else {"decided_by": decided_by}
        policy.update(self.settings.describe())
        monitor = self.monitor.describe()
        return {
            "gpu": bool(self.monitor.devices),
            "message": self.no_gpu_reason,
            "user": self.user,
            "devices": devices,
            "kernels": [self.kernel(grant, paths) for grant in self.ledger.grants()],
            "policy": policy,
            "monitor": monitor,
            "actions": [action.to_json() for action in self.watchdog.history],
            "hard_cap": self.hard_cap.describe(),
            "reasons": {"no_gpu": reason_pair(self.no_gpu_reason), "monitor": reason_pair(monitor["message"])},
            **{name: None for name in SERVER_FIELDS},
            **{name: value() for name, (value, _) in self._server_fields.items()},
        }

    def kernel(self, grant: Grant, paths: Mapping[str, Optional[str]]) -> dict:
        """One kernel: the ledger's grant (caps) with usage next to each cap, its last action, its layers."""
        data = grant.to_json()
        data["id"] = data.pop("kernel_id")
        data["path"] = paths.get(grant.kernel_id)
        for device in data["devices"]:
            device.update(self.kernel_device_usage(grant.kernel_id, device["index"]))
        data["last_action"] = self.last_action(grant.kernel_id)
        data["layers"] = self.hard_cap.kernel_json(grant)
        for name, (value, _) in self._fields.items():
            data[name] = value(grant.kernel_id)
        data["reasons"] = {
            "cpu_only": reason_pair(data.get("cpu_only_reason")),
            "park": reason_pair((data.get("park") or {}).get("reason")),
            "hard_limit": reason_pair((data["layers"] or {}).get("hard_reason")),
        }
        return data

    def kernel_device_usage(self, kernel_id: str, index: int) -> dict:
        """NVML's `used` (None: unknown) and the kernel's own last allocator report on one device."""
        report = (self.reports.get(kernel_id) or {}).get(index)
        return {
            "used": self.monitor.kernel_used(kernel_id, index),
            "allocated": report.allocated if report else None,
            "reserved": report.reserved if report else None,
            "peak": report.peak if report else None,
            "reported_at": report.time if report else None,
        }

    def last_action(self, kernel_id: str) -> Optional[dict]:
        action = self.watchdog.last_action(kernel_id)
        return action.to_json() if action else None

    # --- /metrics -------------------------------------------------------------------------------------

    def metric_families(self) -> list:
        """/metrics at scrape time: the last sample, the ledger's grants and the watchdog's counts now.
        Usage is shown only for kernels that still hold a grant or still run: a released kernel has
        no series, whatever the last sample said."""
        monitor = self.monitor
        sample = monitor.latest
        grants = {g.kernel_id: dict(g.caps) for g in self.ledger.grants()}
        ours = _listed(self.kernels) | set(grants)
        devices = {
            index: (device.total, getattr(sample.devices.get(index), "used", None))
            for index, device in monitor.devices.items()
        }
        families = monitor_families(
            devices,
            {kernel_id: used for kernel_id, used in sample.kernels.items() if kernel_id in ours},
            grants,
            nvml_ok=sample.state == "ok",
            stalled=monitor.is_stalled(),
            sample_age=monitor.sample_age(),
            actions=self.watchdog.counts,
        )
        families.append(hard_limit_family(self.hard_cap.limits()))
        for server_value, server_families in self._server_fields.values():
            if server_families is not None:
                families += server_families(server_value())
        listed = sorted(_listed(self.kernels))
        for kernel_value, field_families in self._fields.values():
            if field_families is not None:
                families += field_families({kernel_id: kernel_value(kernel_id) for kernel_id in listed})
        return families


def _listed(kernels: KernelIds) -> set:
    try:
        return set(kernels.kernel_ids())
    except Exception as error:  # broad: the kernel manager's table changed under us (any kind): the grants alone then
        log.debug("gpu-quota-ext: /metrics without the kernels' list: %r", error)
        return set()
