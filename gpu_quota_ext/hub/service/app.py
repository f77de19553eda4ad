"""`jupyter gpu-quota service`: the host's quota service as a JupyterHub service (tornado).

Settings are traits of `GpuQuotaService` (c.GpuQuotaService.NAME in a config file given with
--config, or on the command line). The hub gives the rest in the environment of a hub-managed service:
JUPYTERHUB_SERVICE_URL (where to listen), JUPYTERHUB_SERVICE_PREFIX (the paths), JUPYTERHUB_API_URL and
JUPYTERHUB_API_TOKEN (the service's own token: never logged, never written), JUPYTERHUB_CLIENT_ID (OAuth
for the admin's page). The caps mapping can come in the environment too, as JSON in
GPU_QUOTA_SERVICE_CAPS ({"users": ..., "groups": ..., "default": ...}): what `service_entry` (spec.py) puts
there for the hub.

This module wires the parts (book.py, store.py, sampler.py, history.py, room.py, polls.py, guard.py, accept.py,
snapshots.py, page.py, handlers.py) and nothing else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Dict, Optional, Tuple
from urllib.parse import urlparse

from jupyter_core.paths import jupyter_data_dir
from tornado import web
from tornado.ioloop import IOLoop, PeriodicCallback
from traitlets import default as default_value
from traitlets.config import Application

from ... import __version__, parking
from ...devices import (
    NvmlInventory,
    StaticInventory,
)
from ...parking import BrokerSettings, HostReading, HostView, decide
from ...policy import PolicyError, build_policy, shown
from ...settings import SETTINGS, parse_value
from ...shared.env_vars import SERVICE_CAPS as CAPS_ENV
from ...shared.service_contract import (
    ADMIN_PAGE,
    ADMIN_SCOPE,
    GRANTS_PATH,
    LEASE_PATH,
    LEASE_RENEW,
    METRICS_PATH,
    ROOM_PATH,
    SERVICE_NAME,
    STATUS_PATH,
)
from ..caps import HOST_KEYS, hub_caps
from .accept import GuardedHTTPServer, raise_descriptor_limit
from .book import HostBook
from .guard import AUTH, Guard, GuardSettings, token_digest
from .handlers import (
    GrantHandler,
    GrantsHandler,
    LeaseHandler,
    MetricsHandler,
    OAuthCallbackHandler,
    PageHandler,
    RoomHandler,
    StatusHandler,
    Who,
)
from .history import UserHistory, user_points
from .hub_directory import HubDirectory, HubUnavailable
from .limits import kept_idle, per_user, reservation_over_budget
from .metrics import registry_for
from .page import page_around, page_body, page_users
from .polls import LongPolls
from .rate import Rate
from .room import HostRoom, ParkReport, check_request, host_round, own_reports
from .sampler import HostSampler
from .snapshots import Snapshots
from .status import build_status
from .store import StateDirError, Store
from .traits import service_trait
from .user_policy import UserPolicy, host_limits, user_policy

log = logging.getLogger("gpu_quota_ext")

BROKER_ROWS = ("park_min_idle", "park_wait_limit", "park_device_margin", "park_host_margin")  # settings.py's rows


def _read_at(sample) -> float:
    """When a host sample's reading began (the broker's "a sample taken after"), for a sample that says so."""
    return sample.read_at if sample.read_at is not None else sample.taken_at


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

    @default_value("state_dir")
    def _state_dir(self):
        return os.path.join(jupyter_data_dir(), "gpu_quota_service")

    def _caps_mapping(self) -> dict:
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

    def initialize(self, argv=None):
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
        self.room = HostRoom()
        held = self.store.load_reservations()
        self.room.restore(held)
        if held:
            log.info("gpu-quota service: %d reservation(s) of resumes under way restored", len(held))
        self.polls = LongPolls()
        self.history = UserHistory()
        self._history_failed = False  # said once in the log, not every sample
        self.policies: Dict[str, UserPolicy] = {}
        self.guard = Guard(self._guard_settings())
        self.kept_idle: Dict[str, Dict[str, int]] = {}  # kernel -> uuid -> idle bytes that could not be parked
        self._identifying: Dict[str, asyncio.Future] = {}  # token digest -> its check with the hub under way
        self.snapshots = Snapshots(self._page_body, self.page_cache_seconds)
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
                values[SETTINGS[name].attribute or name] = parse_value(name, value)
            except PolicyError as error:
                raise PolicyError(f"c.GpuQuotaService.{name} = {shown(value)}: {error}") from None
        return BrokerSettings(**values)

    def _on_round(self, verified, now: float) -> None:
        """After each host sample (the sampler's thread): the book hears which grants a live process holds, the
        host's broker which resumes the sample shows done, then each user's usage and grants of this sample go
        into the admin page's history."""
        self.book.note_round(verified, now)
        sample = self.sampler.last
        if sample is None:
            return
        self.room.note_sample(_read_at(sample), sample.attributed.kernel_used)
        self._note_kept_idle(sample, now)
        sampled = any(used is not None for used in sample.device_used.values())
        try:
            self.history.record(user_points(self.status_now("history", True), sampled))
        except Exception:  # the charts are a view: a failure here must not cost the watchdog a sample
            if not self._history_failed:
                log.exception("gpu-quota service: the admin page's usage history could not be recorded")
            self._history_failed = True

    def _note_kept_idle(self, sample, now: float) -> None:
        """Which kernels keep idle memory that could not be parked (limits.kept_idle), as of this sample; with
        unparkable_idle = "count", the book counts it against their users' budgets."""
        owned = self.book.owned()
        park = self.room.status(owned, "", True, now)["park"]
        kept = kept_idle(park, sample.attributed.kernel_used, self.broker_settings.min_idle)
        self.kept_idle = kept
        if self.unparkable_idle == "count":
            index_of = {d.uuid: d.index for d in self.devices}
            by_user = per_user(kept, {o.grant.kernel_id: o.grant.user for o in owned})
            self.book.set_kept_idle(
                {u: {index_of[uuid]: n for uuid, n in held.items() if uuid in index_of} for u, held in by_user.items()}
            )

    async def page(self, who: Who, user: Optional[str], page: int) -> str:
        """The admin's page as `who` sees it: its body from a snapshot (snapshots.py), the same for every admin."""
        missing = {o.grant.user for o in self.book.visible(who.name, who.admin)} - set(self.policies)
        await asyncio.gather(*(self._quiet_policy(u) for u in missing))  # known ones refresh at each grant
        body = await self.snapshots.get(("" if who.admin else who.name, who.admin, user, page))
        return page_around(who.name, who.admin, body)

    def _page_body(self, view) -> str:
        """In the page's own thread: the status read under the book's and the broker's locks, then rendered."""
        name, admin, user, page = view
        status = self.status_now(name or "admin", admin)
        history = self.history.points(page_users(status, page, user))
        return page_body(status, history, self.poll_interval, page, user)

    def user_history(self, status: dict) -> Dict[str, list]:
        """The history points of the users `status` (what one viewer may see) lists."""
        return self.history.points([row["name"] for row in status["users"]])

    def _granted_uuids(self):
        uuid_of = {d.index: d.uuid for d in self.devices}
        return {
            o.grant.kernel_id: (o.grant.user, tuple(uuid_of[i] for i in o.grant.devices)) for o in self.book.owned()
        }

    # --- the host's broker (room.py) ------------------------------------------------------------

    def hear_lease(self, user: str, server: str, reports: Dict[str, ParkReport], now: float) -> None:
        """A lease's park reports: only of the user's own kernels on that server."""
        self.room.hear(user, server, own_reports(self.book.owned(), user, server, reports), now, lease=True)

    def longest_wait(self) -> float:
        """The longest a lease's long poll waits: a quarter lease, so an answer always comes well before it ends."""
        return max(0.0, min(float(LEASE_RENEW), self.lease_seconds / 4))

    def room_call(
        self,
        user: str,
        server: str,
        reports: Dict[str, ParkReport],
        demands: Dict[str, Dict[str, int]],
        host_park: Optional[Tuple[str, int]] = None,
    ) -> dict:
        """A room call of `user`'s server: checked (room.RoomRefused: nothing kept), then one decision of the host's
        broker over every user's kernels; answers for this server's kernels, wakes the servers asked to park.
        `host_park`: (kernel, bytes) of a park about to begin, promised its host memory or refused (HostRoom)."""
        now = time.time()
        owned = self.book.owned()
        named = dict(reports)
        if host_park is not None and host_park[0] not in named:
            named[host_park[0]] = ParkReport("idle", None, False)  # checked as its own kernel, never heard
        check_request(owned, self.book.devices, user, server, named, {}, None)
        checked = check_request(owned, self.book.devices, user, server, reports, demands, self.room.seen())
        host_answer = None
        if host_park is not None:
            kernel_id, nbytes = host_park
            if kernel_id not in {o.grant.kernel_id for o in owned}:
                host_answer = {"kernel_id": kernel_id, "refused": "the host's GPU quota service holds no grant for it"}
            else:
                refused = self.room.promise_host(
                    kernel_id, nbytes, HostReading(*parking.host_room()), self.broker_settings.host_margin, now
                )
                host_answer = {"kernel_id": kernel_id, "refused": refused}
        self.room.hear(user, server, checked.reports, now, lease=False)
        self.room.ask(user, server, checked.demands, now)
        self.room.expire(now, {o.grant.kernel_id for o in owned}, self.lease_seconds)
        heard, waiting, held, taken = self.room.view()
        sample = self._recent_sample(now)
        available, cgroup = parking.host_room()  # the host's memory (the function, parking's surface)
        round_ = host_round(
            self.book.devices,
            owned,
            sample.device_used if sample is not None else None,
            sample.attributed.kernel_used if sample is not None else {},
            heard,
            waiting,
            held,
            HostView(available, cgroup),
            self.broker_settings,
            user,
            now,
            _read_at(sample) if sample is not None else None,
            taken,
        )
        used: Dict[str, int] = {}  # what the user's kernels use on each device, in the service's sample
        for item in owned:
            if item.grant.user == user and sample is not None:
                for uuid, n in sample.attributed.kernel_used.get(item.grant.kernel_id, {}).items():
                    used[uuid] = used.get(uuid, 0) + n
        if self.unparkable_idle == "count":  # idle memory the user keeps that could not be parked: counted once more
            uuid_of = {d.index: d.uuid for d in self.book.devices.values()}
            for index, n in self.book.kept_idle_of(user).items():
                used[uuid_of[index]] = used.get(uuid_of[index], 0) + n
        limits, by_uuid = self.book.limits_of(user), {d.uuid: d for d in self.book.devices.values()}
        answer = self.room.answer(
            decide(round_),
            user,
            server,
            owned,
            now,
            lambda claimed: reservation_over_budget(used, claimed, by_uuid, limits),
        )
        if answer.go:  # on disk before "go" is answered: a restart of the service keeps the restore's room
            self.store.save_reservations(self.room.reservations())
        for asked in answer.asked:
            log.info(
                "gpu-quota service: the host's broker asks %s's server %r to park idle kernel %s, to make room for "
                "%s's kernel %s",
                asked.user,
                asked.server,
                asked.kernel_id,
                asked.for_user,
                asked.for_kernel,
            )
        for key in answer.wake:
            self.polls.wake(key)
        data = answer.json()
        if host_answer is not None:
            data["host_park"] = host_answer
        for kernel_id in checked.unknown:
            data["waiting"][kernel_id] = "the host's GPU quota service holds no grant for this kernel (released)"
        for kernel_id in checked.demands:
            if kernel_id not in data["go"] and kernel_id not in data["waiting"] and kernel_id not in data["told"]:
                # Not decided (room.host_round): the service's sample still shows the kernel's memory on the GPU.
                data["waiting"][kernel_id] = (
                    "the host's last GPU sample still shows this kernel's memory on the device; waiting for one that "
                    "shows it parked"
                )
        return data

    def _recent_sample(self, now: float):
        """The last host sample, if recent enough to decide on (a stalled or missing one: nothing moves)."""
        sample = self.sampler.last
        if sample is None or self.sampler.state() in ("stalled", "no GPU"):
            return None
        if now - sample.taken_at > max(3 * self.poll_interval, self.stall_after):
            return None
        return sample

    # --- what the handlers ask ------------------------------------------------------------------

    def access_scopes(self) -> set:
        """The scopes a token needs to use this service at all: what the hub gives the service as its access
        scopes (HubAuth.access_scopes, from $JUPYTERHUB_OAUTH_ACCESS_SCOPES), else access to it by name."""
        hub_auth = getattr(self, "hub_auth", None)  # None before connect_hub (unit tests)
        scopes = set(hub_auth.access_scopes) if hub_auth is not None else set()
        return scopes or {f"access:services!service={os.environ.get('JUPYTERHUB_SERVICE_NAME') or SERVICE_NAME}"}

    async def identify(self, handler: web.RequestHandler) -> Who:
        """Who owns the call's token, as the hub says. Failed authentications count against the caller's address
        (guard.py): past its limit, only a token the hub confirmed lately is asked about; a token whose owner has
        no call left on the handler's route is refused before it is checked. Concurrent calls with one token share
        one check: a flood's calls never queue hundreds of the same question to the hub (tornado's client asks 10
        at a time, and the other users' checks would wait behind them)."""
        token = self.hub_auth.get_token(handler, in_cookie=False)
        address = handler.request.remote_ip or ""
        self.guard.before_hub(token, address, getattr(handler, "route", "status"))
        key = token_digest(token) if token else ""
        checking = self._identifying.get(key)
        if checking is None:
            checking = asyncio.ensure_future(self._identify(token))
            self._identifying[key] = checking
            checking.add_done_callback(lambda _: self._identifying.pop(key, None))
        try:
            who = await asyncio.shield(checking)
        except web.HTTPError as error:
            if error.status_code < 500:
                self.guard.failed(address)
            raise
        self.guard.confirmed(token, who.name)
        return who

    async def _identify(self, token: Optional[str]) -> Who:
        if not token:
            raise web.HTTPError(
                401, "this API needs a hub token: Authorization: token <your server's JUPYTERHUB_API_TOKEN>"
            )
        try:
            model = await self.hub_auth.user_for_token(token, sync=False)
        except web.HTTPError as error:
            if error.status_code < 500:
                raise
            # The hub is down or failing: a clear "try again", never a grant without knowing who asks.
            raise web.HTTPError(503, "the hub did not answer: this token cannot be checked now") from None
        if not model:
            raise web.HTTPError(403, "the hub does not know this token")
        return await self.who_for_model(model)

    async def who_for_model(self, model: dict) -> Who:
        scopes = set(model.get("scopes") or ())
        from jupyterhub.services.auth import check_scopes

        try:
            allowed = check_scopes(self.access_scopes(), scopes)
        except ValueError:  # a scope the hub's own parser cannot read: no access, not a traceback
            allowed = set()
        if not allowed:
            # As a JupyterHub service checks (HubAuthenticated.hub_scopes): a token must be given access to
            # this service; being some user's or service's token is not enough.
            raise web.HTTPError(
                403, f"this token was not given access to this service: it needs {sorted(self.access_scopes())}"
            )
        if model.get("kind", "user") != "user":
            if ADMIN_SCOPE in scopes:
                return Who(f"service:{model['name']}", True, model)
            raise web.HTTPError(403, f"service {model.get('name')} is not a user and lacks {ADMIN_SCOPE}")
        try:
            user = await self.directory.user(model["name"])
        except HubUnavailable as error:
            raise web.HTTPError(503, f"cannot ask the hub about this user: {error}") from None
        return Who(user.name, user.admin or ADMIN_SCOPE in scopes, model)

    async def policy_for(self, name: str) -> UserPolicy:
        try:
            user = await self.directory.user(name)
            policy = user_policy(self.caps, self.host_policy, name, user.groups, self.limits)
        except HubUnavailable as error:
            raise web.HTTPError(503, f"cannot ask the hub for {name}'s groups: {error}") from None
        except PolicyError as error:
            raise web.HTTPError(409, f"the hub's caps for {name} are invalid: {error}") from None
        self.policies[name] = policy
        self.book.set_limits(name, policy.limits)
        return policy

    async def status(self, name: str, admin: bool) -> dict:
        users = {o.grant.user for o in self.book.visible(name, admin)} | (
            {name} if not name.startswith("service:") else set()
        )
        await asyncio.gather(*(self._quiet_policy(u) for u in users))
        return self.status_now(name, admin)

    async def _quiet_policy(self, name: str) -> None:
        try:
            await self.policy_for(name)
        except web.HTTPError:
            pass  # the status shows no policy for this user rather than failing for everyone

    def status_now(self, name: str, admin: bool) -> dict:
        now = time.time()
        visible = self.book.visible(name, admin)
        room = self.room.status(visible, name, admin, now)
        kept, counted = self.kept_idle, self.unparkable_idle == "count"
        room["kept_idle"] = [
            {
                "user": o.grant.user,
                "kernel_id": o.grant.kernel_id,
                "server": o.server,
                "held": dict(kept[o.grant.kernel_id]),
                "idle_for": room["park"].get(o.grant.kernel_id, {}).get("idle_for"),
                "declined_park": room["park"].get(o.grant.kernel_id, {}).get("declined_park"),
                "counted": counted,
            }
            for o in visible
            if o.grant.kernel_id in kept
        ]
        if admin:
            room["long_polls"] = self.polls.count()
            room["refused_calls"] = self.guard.refused
            # Host memory promised to parks under way (every user's: HostRoom.promise_host), not yet on the host.
            room["host_memory"] = {"promised": self.room.host_promised()}
        return build_status(
            self.book,
            self.sampler.last,
            self.sampler.state(),
            list(self.sampler.actions),
            dict(self.policies),
            name,
            admin,
            now,
            room,
        )

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
            hub_auth=self.hub_auth,
            hub_oauth=self.hub_oauth,
            cookie_secret=os.urandom(32),  # only the OAuth state and login cookies: a restart signs in again
            login_url=self.hub_oauth.login_url,
            log_function=_access_log,
            xsrf_cookies=False,
        )

    def connect_hub(self) -> None:
        """The hub's side, from the JUPYTERHUB_* environment: token checks, OAuth, users and groups."""
        from jupyterhub.services.auth import HubAuth, HubOAuth

        self.hub_auth = HubAuth(cache_max_age=int(self.hub_cache_seconds))
        self.hub_oauth = HubOAuth(cache_max_age=int(self.hub_cache_seconds))
        self.directory = HubDirectory(self.hub_auth.api_url, self.hub_auth.api_token, self.hub_cache_seconds)

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
        self._expiry_every = max(0.5, min(5.0, self.lease_seconds / 4))
        self._expired_at = time.monotonic()
        expiry = PeriodicCallback(self._expire, self._expiry_every * 1000)
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

    def _expire(self) -> None:
        now, ran = time.time(), time.monotonic()
        silent, self._expired_at = ran - self._expired_at, ran
        if silent > 2 * self._expiry_every:
            # The service did not run (stopped, its loop blocked): no server could renew meanwhile, and their
            # renewals may still wait in its socket's backlog. As after a restart, each lease gets a full period
            # from now: a lease ends for a server's silence, never for the service's own.
            self.book.restore((), self.book.leases(), now)
            log.warning(
                "gpu-quota service: it did not run for %.0f s (stopped or blocked): every server's lease runs a "
                "full period from now",
                silent,
            )
        gone = self.book.expire(now)
        self.room.expire(now, {o.grant.kernel_id for o in self.book.owned()}, self.lease_seconds)
        if gone:
            log.info(
                "gpu-quota service: released %d grant(s) of servers whose lease ran out: %s", len(gone), ", ".join(gone)
            )
        if self.idle_held == "release":
            idle = self.book.release_idle(now)
            if idle:
                log.info(
                    "gpu-quota service: released %d grant(s) no live process of their user held for %g s: %s",
                    len(idle),
                    self.lease_seconds,
                    ", ".join(idle),
                )


def stop_on_signal() -> None:
    """SIGINT or SIGTERM ends the loop, so the store is closed cleanly. The hub stops its services as it
    stops local servers (LocalProcessSpawner.stop): SIGINT first, SIGTERM if that did not do it."""
    import signal

    loop = IOLoop.current()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.asyncio_loop.add_signal_handler(signum, loop.stop)


def main(argv: Optional[list] = None) -> None:
    service = GpuQuotaService.instance()
    service.initialize(argv)
    service.start()


if __name__ == "__main__":
    main()
