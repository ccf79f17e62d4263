"""Robust HTTP(S) download: streamed, timed out, retried with backoff, resumable.

The partial file lives in the user cache (not in the stage's output), keyed by
the URL, so an interrupted download resumes from where it stopped on the next
attempt or the next run, and the stage's output is never half-written.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

from gpt2.core import log
from gpt2.core.digest import sha256_file
from gpt2.core.errors import UserError
from gpt2.core.progress import Progress
from gpt2.data.pypi import cache_dir

logger = log.get("download")

BLOCK = 1 << 20


class _Retryable(Exception):
    """A transfer problem that another attempt may fix."""


def download_url(
    url: str,
    *,
    sha256: str | None = None,
    timeout_s: float = 30.0,
    retries: int = 3,
    backoff_s: float = 1.0,
) -> Path:
    """Download ``url`` into the cache and return the completed file's path.

    Raises :class:`UserError` for a client error (404...), for a transfer that
    still fails after ``retries`` more attempts, and for a checksum mismatch.
    """
    folder = cache_dir() / "downloads"
    folder.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    part = folder / f"{key}.part"
    done = folder / f"{key}.done"
    if done.exists() and looks_like_html(done):  # cached by a version that kept an error page
        logger.info(f"download: the cached copy of {url} is an HTML page, not the corpus; fetching it again")
        done.unlink()
    if not done.exists():
        last_error = ""
        for attempt in range(retries + 1):
            try:
                _fetch_into(url, part, timeout_s)
                if looks_like_html(part):
                    part.unlink()
                    raise UserError(f"{url} answered with an HTML page, not the corpus (an error or login page "
                                    "served with status 200?); nothing was kept: check the URL, and that it serves "
                                    "the file itself")
                os.replace(part, done)
                break
            except _Retryable as exc:
                last_error = str(exc)
                if attempt < retries:
                    delay = backoff_s * 2**attempt
                    logger.info(f"download: {last_error}; retrying in {delay:.1f} s ({attempt + 1}/{retries})")
                    time.sleep(delay)
        else:
            raise UserError(
                f"download of {url} failed after {retries + 1} attempts: {last_error}; "
                "check the URL and your network (a stalled server: raise download.timeout_s); "
                "the next run resumes the partial file"
            )
    if sha256 is not None:
        got = sha256_file(done)
        if got.lower() != sha256.lower():
            done.unlink()
            raise UserError(
                f"{url}: sha256 {got} does not match download.sha256 {sha256.lower()}; "
                "the file was deleted; fix download.sha256 or the URL"
            )
    return done


def looks_like_html(path: Path) -> bool:
    """Whether the file starts as an HTML page does (a corpus of text, JSON Lines or an archive never does)."""
    with open(path, "rb") as handle:
        head = handle.read(512).removeprefix(b"\xef\xbb\xbf").lstrip().lower()
    return head.startswith((b"<!doctype html", b"<html"))


def _fetch_into(url: str, part: Path, timeout_s: float) -> None:
    """One attempt: append to ``part`` from where it stops, until the body is complete."""
    have = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": "gpt2-pipeline", "Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    request = urllib.request.Request(url, headers=headers)
    try:
        response = urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # our partial file is stale or oversized: start over
            part.unlink()
            raise _Retryable("server refused to resume (HTTP 416)") from None
        if 400 <= exc.code < 500 and exc.code not in (408, 425, 429):
            raise UserError(f"download of {url} failed: HTTP {exc.code} {exc.reason}; check the URL") from None
        raise _Retryable(f"HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, TimeoutError, socket.timeout, ConnectionError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise _Retryable(f"cannot connect ({reason})") from None
    with response:
        resumed = have and response.status == 206
        if not resumed:
            have = 0
        length = response.headers.get("Content-Length")
        total = have + int(length) if length is not None else None
        got = have
        with open(part, "ab" if resumed else "wb") as out, Progress("download", total) as progress:
            progress.update(have)
            try:
                while chunk := response.read(BLOCK):
                    out.write(chunk)
                    got += len(chunk)
                    progress.update(len(chunk))
            except (TimeoutError, socket.timeout):
                raise _Retryable(f"no data for {timeout_s:g} s (server stalled) after {got} bytes") from None
            except (http.client.IncompleteRead, ConnectionError, OSError) as exc:
                raise _Retryable(f"connection broke after {got} bytes ({exc.__class__.__name__})") from None
        if total is not None and got < total:
            raise _Retryable(f"body truncated at {got} of {total} bytes")
