"""`jupyter gpu-quota service`: the host's quota service as a JupyterHub service (tornado).

Settings are traits of `GpuQuotaService` (c.GpuQuotaService.NAME in a config file given with
--config, or on the command line), one per row of settings.SERVICE_SETTINGS. The hub gives the rest in the
environment of a hub-managed service: JUPYTERHUB_SERVICE_URL (where to listen), JUPYTERHUB_SERVICE_PREFIX (the
paths), JUPYTERHUB_API_URL and JUPYTERHUB_API_TOKEN (the service's own token: never logged, never written),
JUPYTERHUB_CLIENT_ID (OAuth for the admin's page). The caps mapping can come in the environment too, as JSON in
GPU_QUOTA_SERVICE_CAPS ({"users": ..., "groups": ..., "default": ...}): what `service_entry` (spec.py) puts
there for the hub.

This module wires the parts and nothing else: the book (book.py) and its store (store.py), the host watchdog
(sampler.py), the host's broker (broker.py, around room.py), expiry (expiry.py), who calls (auth.py), each user's
policy (policies.py), the per-user limits (guard.py), the admin page's history and snapshots (history.py,
snapshots.py, page.py), the metrics (metrics.py) and the HTTP API (handlers.py). Its methods are the API the
handlers call, each one part's work.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import AbstractSet, Any, Dict, List, Mapping, Optional, Tuple
from urllib.parse import urlparse

from jupyter_core.paths import jupyter_data_dir
from tornado import web
from tornado.ioloop import IOLoop, PeriodicCallback
from tornado.platform.asyncio import BaseAsyncIOLoop
from traitlets import default as default_value
from traitlets.config import Application

from ... import __version__
from ...devices import NvmlInventory, StaticInventory
from ...parking import BrokerSettings
from ...policy import build_policy
from ...settings import SERVICE_SETTINGS, parse_value
from ...settings_traits import service_trait
from ...shared.env_vars import SERVICE_CAPS as CAPS_ENV
from ...shared.service_contract import (
    ADMIN_PAGE,
    GRANTS_PATH,
    LEASE_PATH,
    LEASE_RENEW,
    METRICS_PATH,
    ROOM_PATH,
    SERVICE_NAME,
    STATUS_PATH,
)
from ...shared.sizes import PolicyError, shown
from ..caps import HOST_KEYS, hub_caps
from .accept import GuardedHTTPServer, raise_descriptor_limit
from .auth import ServiceAuth, Who
from .book import HostBook
from .broker import HostBroker
from .expiry import Expiry
from .guard import AUTH, Guard, GuardSettings
from .handlers import (
    GrantHandler,
    GrantsHandler,
    LeaseHandler,
    MetricsHandler,
    OAuthCallbackHandler,
    PageHandler,
    RoomHandler,
    StatusHandler,
)
from .history import UserHistory, user_points
from .metrics import registry_for
from .page import page_around, page_body, page_users
from .policies import UserPolicies
from .rate import Rate
from .room import ParkReport
from .sampler import HostSampler
from .snapshots import Snapshots
from .status import build_status
from .store import StateDirError, Store
from .user_policy import UserPolicy, host_limits

log = logging.getLogger("gpu_quota_ext")

PageView = Tuple[str, bool, Optional[str], int]  # a snapshot of the admin's page: (viewer, admin, user, page)
BROKER_ROWS = ("park_min_idle", "park_wait_limit", "park_device_margin", "park_host_margin")  # the broker's rows


def _access_log(handler: web.RequestHandler) -> None:
    # The path without its query: a "?token=" must never reach a log. A 429 is not logged one by one: the guard
    # says once a minute who is refused (a flood would otherwise fill the log a line per call).
    request = handler.request
    if handler.get_status() == 429:
        return
    log.info("%d %s %s %.1fms", handler.get_status(), request.method, request.path, 1000.0 * request.request_time())


class GpuQuotaService(Application):
    name = "jupyter-gpu-quota-service"
    version = __version__
    description = """The host's GPU quota service: one ledger for every user of a JupyterHub host. Run by the
    hub (c.JupyterHub.services, see gpu_quota_ext.hub.service.spec.service_entry) or as an external service
    with the JUPYTERHUB_* variables set."""

    # Every setting's trait, from its row in settings.SERVICE_SETTINGS (type, default, help).
    config_file = service_trait("config_file")
    state_dir = service_trait("state_dir")
    users = service_trait("users")
    groups = service_trait("groups")
    default = service_trait("default")
    property_key = service_trait("property_key")
    default_cap = service_trait("default_cap")
    max_cap = service_trait("max_cap")
    overcommit = service_trait("overcommit")
    placement = service_trait("placement")
    on_full = service_trait("on_full")
    on_over_max = service_trait("on_over_max")
    inventory_class = service_trait("inventory_class")
    nvml_class = service_trait("nvml_class")
    poll_interval = service_trait("poll_interval")
    stall_after = service_trait("stall_after")
    max_kernels = service_trait("max_kernels")
    user_budget = service_trait("user_budget")
    idle_held = service_trait("idle_held")
    unmanaged_action = service_trait("unmanaged_action")
    unmanaged_grace = service_trait("unmanaged_grace")
    unix_user_template = service_trait("unix_user_template")
    lease_seconds = service_trait("lease_seconds")
    start_grace = service_trait("start_grace")
    hub_cache_seconds = service_trait("hub_cache_seconds")
    sampler_enabled = service_trait("sampler_enabled")
    room_calls_per_second = service_trait("room_calls_per_second")
    grant_calls_per_second = service_trait("grant_calls_per_second")
    lease_calls_per_second = service_trait("lease_calls_per_second")
    status_calls_per_second = service_trait("status_calls_per_second")
    page_loads_per_second = service_trait("page_loads_per_second")
    failed_auth_per_second = service_trait("failed_auth_per_second")
    rate_burst_seconds = service_trait("rate_burst_seconds")
    max_open_requests = service_trait("max_open_requests")
    refusal_hold_seconds = service_trait("refusal_hold_seconds")
    max_long_polls = service_trait("max_long_polls")
    unparkable_idle = service_trait("unparkable_idle")
    page_cache_seconds = service_trait("page_cache_seconds")
    park_min_idle = service_trait("park_min_idle")
    park_wait_limit = service_trait("park_wait_limit")
    park_device_margin = service_trait("park_device_margin")
    park_host_margin = service_trait("park_host_margin")

    aliases = {"config": "GpuQuotaService.config_file", "state-dir": "GpuQuotaService.state_dir"}
    classes = [StaticInventory, NvmlInventory]

    auth: ServiceAuth  # connect_hub: the hub's side, from the JUPYTERHUB_* environment

    @default_value("state_dir")
    def _state_dir(self) -> str:
        return os.path.join(jupyter_data_dir(), "gpu_quota_service")

    def _caps_mapping(self) -> Dict[str, Any]:
        mapping = {"users": self.users, "groups": self.groups, "default": self.default}
        raw = os.environ.get(CAPS_ENV)
        if raw and not any(mapping.values()):
            try:
                given = json.loads(raw)
            except ValueError:
                raise PolicyError(f"{CAPS_ENV} is not JSON") from None
            if not isinstance(given, dict) or set(given) - {"users", "groups", "default"}:
                raise PolicyError(f'{CAPS_ENV} must be {{"users": ..., "groups": ..., "default": ...}}')
            mapping.update({k: v for k, v in given.items() if v is not None})
        return mapping

    def initialize(self, argv: Optional[List[str]] = None) -> None:
        super().initialize(argv)
        if self.config_file:
            self.load_config_file(self.config_file)
        try:
            self.build()
        except (PolicyError, StateDirError) as error:
            raise SystemExit(f"gpu-quota service: {error}") from None

    def build(self) -> None:
        """Every part, from the settings; raises PolicyError for a bad one."""
        self.host_policy = build_policy(
            self.default_cap, self.max_cap, (), self.overcommit, self.placement, self.on_full, self.on_over_max
        )
        self.limits = host_limits(self.max_kernels, self.user_budget)
        self.broker_settings = self._broker_settings()
        self.caps = hub_caps(**self._caps_mapping(), property_key=self.property_key, extra_keys=HOST_KEYS)
        self.inventory = self.inventory_class(parent=self)
        self.devices = self.inventory.list_devices()
        self.store = Store(self.state_dir, self.devices)
        # A round of PID checks missing this long means they stopped (a hung driver call): nothing is idle then.
        # A sample older than this is too old for the broker to decide on, too.
        check_gap = max(3 * self.poll_interval, self.stall_after)
        self.book = HostBook(
            self.devices, self.host_policy, self.store, self.lease_seconds, self.start_grace, self.limits, check_gap
        )
        owned, leases = self.store.load()
        self.book.restore(owned, leases, time.time())
        log.info("gpu-quota service: %d grant(s) and %d server lease(s) restored", len(owned), len(leases))
        self.sampler = HostSampler(
            self.nvml_class(),
            [d.uuid for d in self.devices],
            self.book.registrations,
            self._granted_uuids,
            self.poll_interval,
            self.stall_after,
            self.unmanaged_action,
            self.unmanaged_grace,
            self.unix_user_template,
            on_round=self._on_round,
        )
        self.broker = HostBroker(
            self.book,
            self.store,
            self.sampler,
            self.broker_settings,
            self.lease_seconds,
            check_gap,
            self.unparkable_idle == "count",
        )
        restored = self.broker.restore()
        if restored:
            log.info("gpu-quota service: %d reservation(s) of resumes under way restored", restored)
        self.expiry = Expiry(self.book, self.broker, self.lease_seconds, self.idle_held == "release")
        self.policies = UserPolicies(self.caps, self.host_policy, self.limits, self.book)
        self.history = UserHistory()
        self._history_failed = False  # said once in the log, not every sample
        self.guard = Guard(self._guard_settings())
        self.snapshots: Snapshots[PageView] = Snapshots(self._page_body, self.page_cache_seconds)
        self.registry = registry_for(lambda: self.status_now("metrics", True))

    def _guard_settings(self) -> GuardSettings:
        per_second = {
            "room": self.room_calls_per_second,
            "grants": self.grant_calls_per_second,
            "lease": self.lease_calls_per_second,
            "status": self.status_calls_per_second,
            "page": self.page_loads_per_second,
            AUTH: self.failed_auth_per_second,
        }
        rates = {route: Rate.of(n, self.rate_burst_seconds) for route, n in per_second.items()}
        return GuardSettings(rates, self.max_open_requests, self.max_long_polls, self.refusal_hold_seconds)

    def _broker_settings(self) -> BrokerSettings:
        values = {}
        for name in BROKER_ROWS:
            value = getattr(self, name)
            try:
                values[SERVICE_SETTINGS[name].attribute or name] = parse_value(name, value)
            except PolicyError as error:
                raise PolicyError(f"c.GpuQuotaService.{name} = {shown(value)}: {error}") from None
        return BrokerSettings(**values)

    def _on_round(self, verified: Mapping[str, Tuple[int, ...]], now: float) -> None:
        """After each host sample (the sampler's thread): the book hears which grants a live process holds, the
        host's broker which resumes the sample shows done, then each user's usage and grants of this sample go
        into the admin page's history."""
        self.book.note_round(verified, now)
        sample = self.sampler.last
        if sample is None:
            return
        self.broker.note_sample(sample, now)
        sampled = any(used is not None for used in sample.device_used.values())
        try:
            self.history.record(user_points(self.status_now("history", True), sampled))
        except Exception:  # the charts are a view: a failure here must not cost the watchdog a sample
            if not self._history_failed:
                log.exception("gpu-quota service: the admin page's usage history could not be recorded")
            self._history_failed = True

    def _granted_uuids(self) -> Dict[str, Tuple[str, Tuple[str, ...]]]:
        uuid_of = {d.index: d.uuid for d in self.devices}
        return {
            o.grant.kernel_id: (o.grant.user, tuple(uuid_of[i] for i in o.grant.devices)) for o in self.book.owned()
        }

    # --- what the handlers ask: each one part's work ------------------------------------------------

    async def identify(self, handler: web.RequestHandler) -> Who:
        """Who owns the call's token, as the hub says (auth.py)."""
        return await self.auth.identify(handler)

    async def who_for_model(self, model: Mapping[str, Any]) -> Who:
        """Who the admin page's signed-in user is (auth.py)."""
        return await self.auth.who_for_model(model)

    async def policy_for(self, name: str) -> UserPolicy:
        """`name`'s policy, asked of the hub now (policies.py)."""
        return await self.policies.policy_for(name, self.auth.directory)

    def room_call(
        self,
        user: str,
        server: str,
        reports: Mapping[str, ParkReport],
        demands: Mapping[str, Mapping[str, int]],
        host_park: Optional[Tuple[str, int]] = None,
        may_wait: AbstractSet[str] = frozenset(),
    ) -> dict:
        """One room call of `user`'s server, decided by the host's broker (broker.py)."""
        return self.broker.room_call(user, server, reports, demands, host_park, time.time(), may_wait)

    async def status(self, name: str, admin: bool) -> dict:
        """The status `name` may see, each user in it with their policy asked anew."""
        users = {o.grant.user for o in self.book.visible(name, admin)} | (
            {name} if not name.startswith("service:") else set()
        )
        await self.policies.refresh(users, self.auth.directory)
        return self.status_now(name, admin)

    def status_now(self, name: str, admin: bool) -> dict:
        """The status `name` may see, from what the parts hold now (status.build_status)."""
        now = time.time()
        room = self.broker.status(self.book.visible(name, admin), name, admin, now)
        if admin:
            room["refused_calls"] = self.guard.refused
        return build_status(
            self.book,
            self.sampler.last,
            self.sampler.state(),
            list(self.sampler.actions),
            dict(self.policies.known),
            name,
            admin,
            now,
            room,
        )

    async def page(self, who: Who, user: Optional[str], page: int) -> str:
        """The admin's page as `who` sees it: its body from a snapshot (snapshots.py), the same for every admin."""
        missing = {o.grant.user for o in self.book.visible(who.name, who.admin)} - set(self.policies.known)
        await self.policies.refresh(missing, self.auth.directory)  # known ones refresh at each grant
        body = await self.snapshots.get(("" if who.admin else who.name, who.admin, user, page))
        return page_around(who.name, who.admin, body)

    def _page_body(self, view: PageView) -> str:
        """In the page's own thread: the status read under the book's and the broker's locks, then rendered."""
        name, admin, user, page = view
        status = self.status_now(name or "admin", admin)
        history = self.history.points(page_users(status, page, user))
        return page_body(status, history, self.poll_interval, page, user)

    def user_history(self, status: dict) -> Dict[str, list]:
        """The history points of the users `status` (what one viewer may see) lists."""
        return self.history.points([row["name"] for row in status["users"]])

    # --- running ---------------------------------------------------------------------------------

    def web_app(self, prefix: str) -> web.Application:
        kernel = r"(?P<kernel_id>[\w-]{1,128})"
        handlers = [
            (prefix + GRANTS_PATH, GrantsHandler),
            (prefix + GRANTS_PATH + "/" + kernel, GrantHandler),
            (prefix + LEASE_PATH, LeaseHandler),
            (prefix + ROOM_PATH, RoomHandler),
            (prefix + STATUS_PATH, StatusHandler),
            (prefix + METRICS_PATH, MetricsHandler),
            (prefix + "oauth_callback", OAuthCallbackHandler),
            (prefix + ADMIN_PAGE, PageHandler),
        ]
        return web.Application(
            handlers,
            gpu_quota_service=self,
            hub_auth=self.auth.hub_auth,
            hub_oauth=self.auth.hub_oauth,
            cookie_secret=os.urandom(32),  # only the OAuth state and login cookies: a restart signs in again
            login_url=self.auth.hub_oauth.login_url,
            log_function=_access_log,
            xsrf_cookies=False,
        )

    def connect_hub(self) -> None:
        """The hub's side, from the JUPYTERHUB_* environment: token checks, OAuth, users and groups."""
        self.auth = ServiceAuth(self.guard, self.hub_cache_seconds)

    def start(self) -> None:
        if not logging.getLogger().handlers and not log.handlers:
            logging.basicConfig(level=logging.INFO, format="[%(levelname)s %(asctime)s %(name)s] %(message)s")

        url = urlparse(os.environ.get("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:10101"))
        prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", f"/services/{SERVICE_NAME}/")
        if not prefix.endswith("/"):
            prefix += "/"
        stop_on_signal()
        self.connect_hub()
        app = self.web_app(prefix)
        descriptors = raise_descriptor_limit()
        server = GuardedHTTPServer(
            app,
            xheaders=True,
            # A kept-alive connection with no request in it is closed after this long: servers renew every
            # LEASE_RENEW s, and an idle connection holds a file descriptor.
            idle_connection_timeout=max(60.0, 4.0 * LEASE_RENEW),
            on_exhausted=lambda: self.guard.out_of_descriptors(descriptors),
        )
        server.listen(url.port or 80, url.hostname or "127.0.0.1")
        if self.sampler_enabled:
            self.sampler.start()
        self.expiry.last = time.monotonic()  # the checks start now: the time since build() was no pause
        expiry = PeriodicCallback(self.expiry.tick, self.expiry.every * 1000)
        expiry.start()
        log.info(
            "gpu-quota service: %d GPU(s), %d grant(s), listening on %s:%s%s (open files limit %s)",
            len(self.devices),
            len(self.book.owned()),
            url.hostname,
            url.port,
            prefix,
            descriptors,
        )
        try:
            IOLoop.current().start()
        finally:
            expiry.stop()
            server.stop()
            self.snapshots.close()
            self.sampler.stop()
            self.store.close()


def stop_on_signal() -> None:
    """SIGINT or SIGTERM ends the loop, so the store is closed cleanly. The hub stops its services as it
    stops local servers (LocalProcessSpawner.stop): SIGINT first, SIGTERM if that did not do it."""
    import signal

    loop = IOLoop.current()
    assert isinstance(loop, BaseAsyncIOLoop)  # tornado 5 and later: every IOLoop runs on asyncio
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.asyncio_loop.add_signal_handler(signum, loop.stop)


def main(argv: Optional[list] = None) -> None:
    service = GpuQuotaService.instance()
    service.initialize(argv)
    service.start()


if __name__ == "__main__":
    main()
