"""URL downloads against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import hashlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpt2.core.errors import UserError
from gpt2.data.http import download_url

BODY = b"".join(b"line %d of a served corpus\n" % i for i in range(5000))


class Handler(BaseHTTPRequestHandler):
    truncated_once: set[str] = set()
    server_fixed = False
    ranges: list[str | None] = []

    def log_message(self, *args):  # keep test output clean
        pass

    def do_GET(self):
        self.ranges.append(self.headers.get("Range"))
        if self.path == "/missing":
            self.send_error(404, "Not Found")
        elif self.path == "/stall":
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY[:100])
            self.wfile.flush()
            time.sleep(2)
        elif self.path == "/flaky" and "/flaky" not in self.truncated_once:
            self.truncated_once.add("/flaky")
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            self.wfile.write(BODY[:40000])  # then hang up: a truncated body
        elif self.path == "/always-short":
            self.send_response(200)
            self.send_header("Content-Length", str(len(BODY) + 10))
            self.end_headers()
            self.wfile.write(BODY)
        elif self.path == "/error500":
            self.send_error(500, "Boom")
        elif self.path == "/login-page" and not self.server_fixed:  # an error page with status 200
            page = b"<!DOCTYPE html>\n<html><body>Please sign in</body></html>\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)
        else:
            self._serve_with_ranges()

    def _serve_with_ranges(self):
        start = 0
        header = self.headers.get("Range")
        if header and self.path != "/norange":
            start = int(header.split("=")[1].split("-")[0])
            if start >= len(BODY):
                self.send_error(416)
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(BODY) - 1}/{len(BODY)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(BODY) - start))
        self.end_headers()
        self.wfile.write(BODY[start:])


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path / "cache"))
    Handler.truncated_once = set()
    Handler.server_fixed = False
    Handler.ranges = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    # shutdown() waits out the poll interval: 0.5 s by default, in each of the file's tests
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


FAST = dict(timeout_s=0.5, retries=2, backoff_s=0.0)


def test_downloads_the_body(server):
    path = download_url(f"{server}/corpus.txt", **FAST)
    assert path.read_bytes() == BODY


def test_checksum_ok(server):
    digest = hashlib.sha256(BODY).hexdigest()
    assert download_url(f"{server}/corpus.txt", sha256=digest, **FAST).read_bytes() == BODY


def test_checksum_mismatch_deletes_the_file(server, tmp_path):
    with pytest.raises(UserError, match="does not match download.sha256"):
        download_url(f"{server}/corpus.txt", sha256="0" * 64, **FAST)
    assert not list((tmp_path / "cache" / "downloads").iterdir())


def test_404_fails_at_once_with_the_status(server):
    with pytest.raises(UserError, match="HTTP 404.*check the URL"):
        download_url(f"{server}/missing", **FAST)
    assert Handler.ranges == [None]  # a client error is not retried


def test_stalled_server_times_out_after_retries(server):
    start = time.perf_counter()
    with pytest.raises(UserError, match="failed after 3 attempts.*stalled"):
        download_url(f"{server}/stall", **FAST)
    assert time.perf_counter() - start < 10


def test_truncated_body_is_resumed_with_a_range_request(server):
    path = download_url(f"{server}/flaky", **FAST)
    assert path.read_bytes() == BODY
    assert Handler.ranges == [None, "bytes=40000-"]


def test_body_always_short_is_an_error(server):
    with pytest.raises(UserError, match="truncated"):
        download_url(f"{server}/always-short", **FAST)


def test_server_error_is_retried_then_reported(server):
    with pytest.raises(UserError, match="HTTP 500"):
        download_url(f"{server}/error500", **FAST)
    assert len(Handler.ranges) == 3


def test_partial_file_from_an_earlier_run_is_resumed(server, tmp_path):
    url = f"{server}/corpus.txt"
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    part = tmp_path / "cache" / "downloads" / f"{key}.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(BODY[:1234])
    assert download_url(url, **FAST).read_bytes() == BODY
    assert Handler.ranges == ["bytes=1234-"]


def test_server_ignoring_range_restarts_cleanly(server, tmp_path):
    url = f"{server}/norange"
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    part = tmp_path / "cache" / "downloads" / f"{key}.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"garbage")
    assert download_url(url, **FAST).read_bytes() == BODY


def test_unreachable_host(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2_CACHE_DIR", str(tmp_path))
    with pytest.raises(UserError, match="cannot connect"):
        download_url("http://127.0.0.1:9/nothing", timeout_s=0.5, retries=0, backoff_s=0)


def test_an_html_page_served_with_status_200_is_refused_and_never_cached(server, tmp_path):
    with pytest.raises(UserError, match=r"login-page answered with an HTML page, not the corpus .*nothing was kept"):
        download_url(f"{server}/login-page", retries=0)
    Handler.server_fixed = True  # the next download gets the file, not a cached error page
    assert download_url(f"{server}/login-page", retries=0).read_bytes() == BODY
