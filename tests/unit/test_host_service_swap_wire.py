"""A swap's words on the host service's wire, through its web app (no hub: the hub's answer for each token is
given): a room call's "releases_as_copied" and "may_wait" reach the room as said, its answer always has "freeing",
and a body whose words are not booleans is refused whole (400, nothing of it kept). What the room believes of
those words: tests/unit/test_host_room.py."""

import json

import pytest

from gpu_quota_ext.hub.service.app import GpuQuotaService
from gpu_quota_ext.hub.service.auth import Who
from gpu_quota_ext.shared.service_contract import GRANTS_PATH, ROOM_PATH

from .host_service import hub_down, hub_says, serve, service_config


@pytest.fixture
def service(tmp_path, monkeypatch):
    hub_down(monkeypatch)
    app = GpuQuotaService(config=service_config(tmp_path))
    app.build()
    app.connect_hub()

    async def identify(token):
        return Who("bob", False, {"kind": "user", "name": "bob"})

    hub_says(app, monkeypatch, identify)
    yield app
    app.store.close()


async def call(client, url, body):
    answer = await client.fetch(
        url, method="POST", body=json.dumps(body), headers={"Authorization": "token bob-token"}, raise_error=False,
        request_timeout=30,
    )
    return answer.code, json.loads(answer.body or b"{}")


def room_body(parking_word=True, wait_word=True):
    return {
        "server": "",
        "park": [{"kernel_id": "k1", "state": "parking", "idle_for": None, "parkable": False,
                  "releases_as_copied": parking_word}],
        "demands": [{"kernel_id": "k2", "need": {"GPU-a": 1 << 30}, "may_wait": wait_word}],
    }


@pytest.mark.parametrize(
    "body, line",
    [
        (room_body(parking_word="yes"), '"releases_as_copied" of kernel k1 must be true or false'),
        (room_body(wait_word=1), '"may_wait" of kernel k2 must be true or false'),
    ],
)
def test_a_room_call_whose_swap_words_are_not_booleans_is_refused_and_nothing_is_kept(service, body, line):
    async def scenario(base, client):
        for kernel_id in ("k1", "k2"):
            grant = {"server": "", "kernel_id": kernel_id, "kernelspec": "python3"}
            assert (await call(client, base + GRANTS_PATH, grant))[0] == 201
        code, answer = await call(client, base + ROOM_PATH, body)
        assert code == 400 and line in answer["message"], answer

    serve(service, scenario)
    heard, waiting, held, taken = service.broker.room.view()
    assert heard == {} and waiting == [] and held == []


def test_a_room_call_s_swap_words_reach_the_room_and_its_answer_says_what_is_being_freed(service):
    async def scenario(base, client):
        for kernel_id in ("k1", "k2"):
            grant = {"server": "", "kernel_id": kernel_id, "kernelspec": "python3"}
            assert (await call(client, base + GRANTS_PATH, grant))[0] == 201
        code, answer = await call(client, base + ROOM_PATH, room_body())
        assert code == 200 and answer["go"] == [] and answer["freeing"] == {}, answer  # no sample yet: it waits

    serve(service, scenario)
    heard, waiting, _, _ = service.broker.room.view()
    assert heard["k1"].report.releases_as_copied is True
    assert [(w.kernel_id, w.may_wait) for w in waiting] == [("k2", True)]
