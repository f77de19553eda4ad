"""REST routes of parking: POST kernels/<id>/park and POST kernels/<id>/resume (shared.contract).

Same authorization as the other kernel routes: the server's user, or the kernel itself with its own
secret. The body is empty or `{}`. Both answer at once, without waiting for the driver: 202 with the
kernel's park object (`{"park": {...}}`, shared.contract.PARK_FIELDS) when the request was taken, 409
with the same object (`parkable` false, `reason` saying why) and a `message` when parking cannot work
for it, 404 for a kernel this server does not have.
"""

from __future__ import annotations

import json

from jupyter_server.utils import url_path_join
from tornado import web

from .handlers import KERNEL_ID_PATTERN, GpuQuotaHandler, allow_unauthenticated
from .parker import UnknownKernel
from .shared.contract import KERNELS_PATH, PARK_SUFFIX, RESUME_SUFFIX
from .shared.sizes import shown


class _ParkRoute(GpuQuotaHandler):
    action = "park"

    async def _request(self, parker, kernel_id: str, who: str):
        raise NotImplementedError

    @allow_unauthenticated
    async def post(self, kernel_id: str):
        who = self.require_user_or_kernel(kernel_id, "write")
        body = self.read_json_body()
        if body not in (None, {}):
            raise web.HTTPError(400, f"POST {self.action} takes no fields: send no body or {{}}")
        try:
            accepted, park = await self._request(self.manager.parker, kernel_id, who)
        except UnknownKernel:
            raise web.HTTPError(404, f"no kernel {shown(kernel_id)} on this server") from None
        answer = {"park": park}
        if not accepted:
            self.set_status(409)
            answer["message"] = park["reason"]
        else:
            self.set_status(202)
        self.log.info("gpu-quota-ext: kernel %s %s request (%s): %s", kernel_id, self.action, who, park["state"])
        self.finish(json.dumps(answer))


class ParkHandler(_ParkRoute):
    action = "park"

    async def _request(self, parker, kernel_id, who):
        return await parker.request_park(kernel_id, who)


class ResumeHandler(_ParkRoute):
    action = "resume"

    async def _request(self, parker, kernel_id, who):
        return await parker.request_resume(kernel_id, who)


PARK_HANDLERS = [
    (url_path_join(KERNELS_PATH, KERNEL_ID_PATTERN, PARK_SUFFIX), ParkHandler),
    (url_path_join(KERNELS_PATH, KERNEL_ID_PATTERN, RESUME_SUFFIX), ResumeHandler),
]

