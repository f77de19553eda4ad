"""A streamed request body is kept only up to the limit, for both HTTP APIs (shared/request_body.py)."""

import pytest

from gpu_quota_ext.shared.contract import MAX_BODY
from gpu_quota_ext.shared.request_body import BodyRefused, BoundedBody


def test_a_body_within_the_limit_is_kept_and_read_as_json():
    body = BoundedBody(limit=16)
    for chunk in (b'{"cap":', b' "1GiB"}'):
        body.add(chunk)
    assert not body.over and body.json() == {"cap": "1GiB"}
    assert BoundedBody().json() is None and BoundedBody().limit == MAX_BODY


def refusal(body: BoundedBody):
    with pytest.raises(BodyRefused) as refused:
        body.json()
    return refused.value.status, str(refused.value)


def test_a_body_that_grows_past_the_limit_is_dropped_and_stays_over():
    body = BoundedBody(limit=16)
    body.add(b"x" * 16)
    assert not body.over
    body.add(b"y")
    assert body.over and bytes(body._data) == b""  # nothing of it is held
    body.add(b"{}")
    assert body.over and refusal(body) == (413, "the request body is over 64 KiB, the most this API reads")


def test_a_refused_body_is_dropped_as_it_arrives():
    body = BoundedBody()
    body.drop()
    body.add(b"{}")
    assert body.over and refusal(body)[0] == 413


@pytest.mark.parametrize("raw", [b"not json", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000])
def test_what_is_not_json_is_refused_with_a_400(raw):
    body = BoundedBody(limit=len(raw))
    body.add(raw)
    assert refusal(body) == (400, "the body is not JSON")


def test_the_headers_say_what_is_declared_and_whether_a_body_follows():
    fits = BoundedBody({"Content-Length": "12"}, limit=16)
    assert (fits.declared, fits.malformed, fits.follows, fits.over) == (12, None, True, False)
    declared_too_large = BoundedBody({"Content-Length": "17"}, limit=16)
    declared_too_large.add(b"{}")
    assert declared_too_large.over and refusal(declared_too_large)[0] == 413  # dropped before a byte arrives
    chunked = BoundedBody({"Transfer-Encoding": "chunked"})
    assert (chunked.declared, chunked.follows, chunked.over) == (None, True, False)
    assert not BoundedBody({}).follows and not BoundedBody({"Content-Length": "0"}).follows


@pytest.mark.parametrize("length", ["abc", "1, 2", "-5", "\u00b3"])
def test_a_malformed_content_length_is_said_and_its_body_dropped(length):
    body = BoundedBody({"Content-Length": length})
    assert body.malformed and "not a number of bytes" in body.malformed
    assert body.over and body.follows  # unknown: as if it did
