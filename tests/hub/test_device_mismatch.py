"""Issue 19, item 5: the host quota service and a user's server that list the host's GPUs by different UUIDs.

A real JupyterHub, its proxy and the host service (configure_host_service) on a host whose one GPU is
"GPU-hubtest-0"; the user's server lists one GPU of another UUID (a wrong static inventory, or a server that
sees another CUDA_VISIBLE_DEVICES). Every kernel start used to be a 503 saying "GPU budget full", and the
service kept each unusable grant until the server's lease ran out. Now the start says what is wrong, with
its own reason, and the service holds nothing after it.

Install what it needs with `bash tests/hub/setup.sh`.
"""

from __future__ import annotations

import asyncio
import tempfile
import textwrap
from pathlib import Path

import pytest

from gpu_quota_ext.shared.service_contract import GRANTS_PATH

from .hubtools import Hub
from .quota_service import quota_service_config

HOST_UUID = "GPU-hubtest-0"
SERVER_UUID = "GPU-not-the-hosts"

SINGLE_USER_CONFIG = f"""
c.ServerApp.jpserver_extensions = {{"gpu_quota_ext": True}}
c.GpuQuota.inventory_class = "gpu_quota_ext.devices.StaticInventory"
c.StaticInventory.devices = [{{"name": "Hub test GPU", "total": "80GiB", "uuid": {SERVER_UUID!r}}}]
"""

HUB_CONFIG = """
c.Spawner.args = ["--allow-root", "--config={single_user_config}"]
from gpu_quota_ext.hub.service.configure import configure_host_service

configure_host_service(
    c,
    default={{"default_cap": "0.25", "max_cap": "0.5", "on_full": "refuse"}},
    port={port},
    args=["--config={service_config}"],
    admin_roles=["hub-test-admin"],
)
"""


@pytest.mark.timeout(300)
def test_a_server_with_other_gpus_is_told_so_and_the_service_keeps_no_grant(setup_ok, tmp_path):
    shared = Path(tempfile.mkdtemp(prefix="gq-mismatch-"))
    single_user_config = shared / "single_user_config.py"
    single_user_config.write_text(SINGLE_USER_CONFIG)
    _, service = quota_service_config(
        tmp_path,
        devices=({"name": "Test GPU", "total": "80GiB", "uuid": HOST_UUID},),
        settings={"lease_seconds": 120.0},  # long: only the server's give-back can empty the service in time
    )
    hub = Hub(
        tmp_path,
        textwrap.dedent(
            HUB_CONFIG.format(
                single_user_config=single_user_config, port=service.port, service_config=service.config_path
            )
        ),
    )
    hub.start()
    try:
        asyncio.run(_scenario(hub, service))
    except BaseException:
        print("---- jupyterhub log (tail) ----\n" + hub.log_tail(12000))
        raise
    finally:
        hub.stop()
        single_user_config.unlink()
        shared.rmdir()


async def _scenario(hub: Hub, service) -> None:
    await hub.wait_until_up()
    user = "mia"
    await hub.api("POST", f"/hub/api/users/{user}", ok=(201, 409))
    await hub.start_server(user)
    await hub.wait_for_server(user)
    token = await hub.user_token(user)
    for _ in range(3):
        code, answer = await hub.api(
            "POST", f"/user/{user}/api/kernels", {"name": "python3"}, token=token, ok=(500, 503)
        )
        assert code == 503 and answer["reason"] == "GPU quota service has other GPUs", (code, answer)
        message = answer["message"]
        assert f"granted device '{HOST_UUID}', which this server does not have: it has '{SERVER_UUID}'" in message
        assert "budget" not in message and "given back" in message, message
        # Given back at once: the service holds no grant for this server (its lease would keep one 120 s).
        _, held = await hub.api("GET", service.path(GRANTS_PATH))
        assert held["grants"] == [], held
    _, kernels = await hub.api("GET", f"/user/{user}/api/kernels", token=token)
    assert kernels == []
