"""A hub whose port another process took before it bound it is started again on other ports (hubtools:
JupyterHub and its proxy bind the ports of their config themselves and take no bound socket)."""

import asyncio
import socket

from .hubtools import Hub


def test_a_hub_whose_port_was_taken_is_started_again_on_others(setup_ok, tmp_path):
    hub = Hub(tmp_path, "")
    taken = socket.socket()
    taken.bind(("127.0.0.1", hub.port))  # as another process would between the pick and the proxy's bind
    taken.listen()
    hub.start()
    try:
        asyncio.run(hub.wait_until_up())
        assert hub.starts == 2 and hub.port != taken.getsockname()[1]
    except BaseException:
        print("---- jupyterhub log (tail) ----\n" + hub.log_tail())
        raise
    finally:
        hub.stop()
        taken.close()
