"""An HTTP client that goes through JupyterHub's login the way a browser does: one requests.Session keeps
every cookie (the hub's and the service's, each on its own path) and follows every redirect; a login form
is read from the page it came on and submitted with its hidden fields (JupyterHub's `_xsrf`)."""

from __future__ import annotations

from html.parser import HTMLParser
from typing import Dict, List, Optional, Tuple
from urllib.parse import urljoin, urlparse

import requests

TIMEOUT = 30  # seconds for one request, redirects included


class _FormReader(HTMLParser):
    """The first <form> of a page: its action and its inputs' names and values."""

    def __init__(self):
        super().__init__()
        self.action: Optional[str] = None
        self.fields: Dict[str, str] = {}
        self._inside = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "form" and self.action is None:
            self.action, self._inside = attrs.get("action") or "", True
        elif tag == "input" and self._inside and attrs.get("name"):
            self.fields[attrs["name"]] = attrs.get("value") or ""

    def handle_endtag(self, tag):
        if tag == "form":
            self._inside = False


def read_form(html: str) -> Tuple[str, Dict[str, str]]:
    reader = _FormReader()
    reader.feed(html)
    if reader.action is None:
        raise AssertionError(f"no form on this page:\n{html[:2000]}")
    return reader.action, reader.fields


class Browser:
    def __init__(self, base_url: str):
        self.base_url = base_url
        self.session = requests.Session()

    def open(self, path: str) -> requests.Response:
        return self.session.get(urljoin(self.base_url, path), timeout=TIMEOUT)

    def submit_login(self, page: requests.Response, username: str, password: str) -> requests.Response:
        """Fill in the login form of `page` and send it, as a person pressing "Sign in" does."""
        action, fields = read_form(page.text)
        fields.update(username=username, password=password)
        return self.session.post(urljoin(page.url, action), data=fields, timeout=TIMEOUT)


def path_of(url: str) -> str:
    return urlparse(url).path


def visited(response: requests.Response) -> List[str]:
    """The path of every address the request went through, redirects first, the last one's too."""
    return [path_of(r.url) for r in response.history] + [path_of(response.url)]
