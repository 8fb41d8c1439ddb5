"""A small GitHub REST client on `urllib.request`: token auth, Link pagination, bounded retries.

What it does about GitHub's documented behaviour (GitHub's "Rate limits for the REST
API" and "Best practices" pages):

- **Writes are serial and spaced.** `POST`/`PATCH`/`PUT`/`DELETE` wait until `min_write_interval`
  seconds (default 1) have passed since the previous write; content creation is limited to about
  80 per minute and 500 per hour.
- **Rate limits.** A 403 or 429 is a rate limit when it carries `retry-after`, or
  `x-ratelimit-remaining: 0`, or a message naming a rate limit. The client waits `retry-after`
  seconds, else until `x-ratelimit-reset` (UTC epoch seconds), else (a secondary limit without
  headers) at least 60 s, doubling on each further limit. A wait longer than `max_wait`, or more
  than `max_retries` limits in a row, is not slept: `RateLimited` is raised at once so the caller
  keeps a draft.
- **Permission.** A 403 that is not a rate limit (a fork PR's read-only `GITHUB_TOKEN`: "Resource
  not accessible by integration") raises `PermissionDenied`; retrying cannot help.
- **Transient failures.** 5xx answers, timeouts and dropped connections are retried with
  exponential backoff (`backoff` × 2^n seconds, capped by `max_wait`), `max_retries` times. A POST
  is not retried here: GitHub may have created the issue or comment before failing, so the caller
  looks for it first and then retries (`ServerUnavailable.uncertain`).
- **Pagination.** `paginate()` follows the `Link` header's `rel="next"` URL, only while it stays on
  the API's own scheme and host (the token is never sent elsewhere), and never visits a URL twice.
- **The token** goes into the `Authorization` header only. It is never part of an exception
  message or `repr`; `redact()` scrubs it from any text as a second line of defence. Redirects are
  followed by hand and only to the same host, because urllib would forward the header anywhere.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from ..errors import GitHubError

DEFAULT_API_URL = "https://api.github.com"
API_VERSION = "2022-11-28"
USER_AGENT = "deepview-ci"
SECONDARY_LIMIT_MIN_WAIT = 60.0  # GitHub: "otherwise, wait for at least one minute"
WRITE_METHODS = frozenset({"POST", "PATCH", "PUT", "DELETE"})
_LINK_PART = re.compile(r'<([^>]*)>\s*((?:;\s*[^;,]+)*)')
_REL = re.compile(r'rel\s*=\s*"?([^";,]+)"?', re.IGNORECASE)


@dataclass(frozen=True, kw_only=True)
class ClientOptions:
    """Resolved client settings. Tests set the waits to 0; production keeps GitHub's advice."""

    timeout: float = 30.0  # seconds per request
    max_retries: int = 4  # retries per request for rate limits and transient failures
    backoff: float = 2.0  # first transient-failure wait, doubled each retry
    max_wait: float = 300.0  # never sleep longer than this for one wait; raise instead
    min_write_interval: float = 1.0  # seconds between two writes


@dataclass(frozen=True)
class Response:
    status: int
    headers: Mapping[str, str]  # lower-cased names
    data: Any  # decoded JSON, or None for an empty body
    url: str

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


class ApiError(GitHubError):
    """The API answered with an error, or could not be reached. `status` is None for network errors."""

    kind = "api"

    def __init__(self, message: str, *, status: int | None = None, hint: str | None = None,
                 api_message: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.status = status
        self.api_message = api_message

    @property
    def fatal(self) -> bool:
        """True when further requests in this run would fail the same way (stop and keep drafts)."""
        return True


class Unauthorized(ApiError):
    kind = "auth"


class PermissionDenied(ApiError):
    kind = "permission"


class NotFound(ApiError):
    kind = "not_found"

    @property
    def fatal(self) -> bool:
        return False


class ValidationFailed(ApiError):
    """422: the request itself is wrong (e.g. a body over 65 536 characters); other requests may pass."""

    kind = "validation"

    @property
    def fatal(self) -> bool:
        return False


class RateLimited(ApiError):
    kind = "rate_limit"


class ServerUnavailable(ApiError):
    """5xx, timeout or dropped connection, after the retries. `uncertain`: a POST whose effect is unknown."""

    kind = "server"

    def __init__(self, message: str, *, uncertain: bool = False, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.uncertain = uncertain


def redact(text: str, secret: str | None) -> str:
    """`text` with every occurrence of `secret` replaced by `***`."""
    if secret and len(secret) >= 4:
        return text.replace(secret, "***")
    return text


def parse_link_header(value: str | None) -> dict[str, str]:
    """`Link: <url>; rel="next", <url>; rel="last"` → {"next": url, "last": url}."""
    links: dict[str, str] = {}
    if not value:
        return links
    for m in _LINK_PART.finditer(value):
        url, params = m.group(1).strip(), m.group(2)
        for rel in _REL.findall(params or ""):
            for name in rel.split():
                links.setdefault(name.lower(), url)
    return links


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None  # surfaced as HTTPError; followed by hand, same host only


@dataclass
class GitHubClient:
    """REST calls against `api_url` (github.com or a GHES `https://HOST/api/v3`)."""

    api_url: str
    token: str = field(repr=False)
    options: ClientOptions = field(default_factory=ClientOptions)
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    clock: Callable[[], float] = field(default=time.time, repr=False)  # wall clock, for x-ratelimit-reset
    monotonic: Callable[[], float] = field(default=time.monotonic, repr=False)
    waits: list[float] = field(default_factory=list, repr=False)  # every sleep taken, for reports and tests
    requests_made: int = 0
    _last_write: float | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.api_url = (self.api_url or DEFAULT_API_URL).rstrip("/")
        parsed = urllib.parse.urlsplit(self.api_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise GitHubError(
                f"GITHUB_API_URL {self.api_url!r} is not an http(s) URL",
                hint="use https://api.github.com, or https://HOST/api/v3 for GitHub Enterprise Server",
            )
        self._origin = (parsed.scheme, parsed.netloc.lower())
        handlers: list[Any] = [_NoRedirect()]
        if _is_loopback(parsed.hostname):
            handlers.append(urllib.request.ProxyHandler({}))  # a local server is never behind a proxy
        self._opener = urllib.request.build_opener(*handlers)

    # ------------------------------------------------------------------ public

    def get(self, path: str, params: Mapping[str, Any] | None = None) -> Response:
        return self.request("GET", path, params=params)

    def post(self, path: str, body: Mapping[str, Any]) -> Response:
        return self.request("POST", path, body=body)

    def patch(self, path: str, body: Mapping[str, Any]) -> Response:
        return self.request("PATCH", path, body=body)

    def paginate(self, path: str, params: Mapping[str, Any] | None = None, *, max_pages: int = 1000) -> Iterator[Any]:
        """Every item of a list endpoint, page after page, by the `Link` header's `next`."""
        params = {"per_page": 100, **(params or {})}
        url: str | None = self._url(path, params)
        seen: set[str] = set()
        pages = 0
        while url and url not in seen and pages < max_pages:
            seen.add(url)
            pages += 1
            resp = self._request_url("GET", url, None)
            if not isinstance(resp.data, list):
                raise ApiError(f"GET {self._show(url)}: expected a JSON list, got {type(resp.data).__name__}",
                               status=resp.status)
            yield from resp.data
            nxt = parse_link_header(resp.header("link")).get("next")
            url = self._same_origin(urllib.parse.urljoin(url, nxt)) if nxt else None

    def request(self, method: str, path: str, *, params: Mapping[str, Any] | None = None,
                body: Mapping[str, Any] | None = None) -> Response:
        return self._request_url(method.upper(), self._url(path, params), body)

    # ------------------------------------------------------------------ internals

    def _url(self, path: str, params: Mapping[str, Any] | None) -> str:
        url = self.api_url + "/" + path.lstrip("/")
        if params:
            url += "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        return url

    def _same_origin(self, url: str) -> str | None:
        p = urllib.parse.urlsplit(url)
        return url if (p.scheme, p.netloc.lower()) == self._origin else None

    def _show(self, url: str) -> str:
        """A URL as shown in messages: the path and query, relative to the API root."""
        return redact(url[len(self.api_url):] if url.startswith(self.api_url) else url, self.token)

    def wait(self, seconds: float) -> None:
        """Sleep, and record it in `waits`."""
        if seconds > 0:
            self.waits.append(seconds)
            self.sleep(seconds)

    def _space_writes(self, method: str) -> None:
        if method not in WRITE_METHODS:
            return
        if self._last_write is not None:
            left = self.options.min_write_interval - (self.monotonic() - self._last_write)
            if left > 0:
                self.wait(left)

    def _request_url(self, method: str, url: str, body: Mapping[str, Any] | None) -> Response:
        attempt = 0
        rate_limits = 0
        redirects = 0
        while True:
            self._space_writes(method)
            try:
                resp = self._send(method, url, body)
            except _Retryable as exc:
                attempt += 1
                wait = self.options.backoff * (2 ** (attempt - 1))
                uncertain = method == "POST"  # it may have been created anyway: the caller checks first
                if uncertain or attempt > self.options.max_retries or wait > self.options.max_wait:
                    raise ServerUnavailable(
                        f"{method} {self._show(url)}: {exc.reason}"
                        + ("" if uncertain else f" (gave up after {attempt} attempt(s))"),
                        status=exc.status,
                        uncertain=uncertain,
                        hint="GitHub (or GITHUB_API_URL) is unreachable or failing; rerun later. "
                        "What was not filed is kept as drafts",
                    ) from None
                self.wait(wait)
                continue
            except _Redirect as exc:
                target = self._same_origin(urllib.parse.urljoin(url, exc.location))
                redirects += 1
                if target is None or redirects > 3:
                    raise ApiError(f"{method} {self._show(url)}: redirected off the API host or too often",
                                   status=exc.status) from None
                url = target
                continue
            except _RateLimit as exc:
                rate_limits += 1
                if not exc.exact:
                    exc.wait *= 2 ** (rate_limits - 1)
                if exc.wait > self.options.max_wait or rate_limits > self.options.max_retries:
                    why = (f"would wait {exc.wait:.0f} s, over the {self.options.max_wait:.0f} s limit"
                           if exc.wait > self.options.max_wait else f"still limited after {rate_limits - 1} wait(s)")
                    raise RateLimited(
                        f"{method} {self._show(url)}: rate limited ({exc.detail}); {why}",
                        status=exc.status,
                        hint="rerun later (or raise --max-wait); what was not filed is kept as drafts",
                    ) from None
                self.wait(exc.wait)
                continue
            return resp

    def _send(self, method: str, url: str, body: Mapping[str, Any] | None) -> Response:
        data = json.dumps(body).encode("utf-8") if body is not None else None
        headers = {
            "Accept": "application/vnd.github+json",
            "X-GitHub-Api-Version": API_VERSION,
            "User-Agent": USER_AGENT,
            "Authorization": f"Bearer {self.token}",
        }
        if data is not None:
            headers["Content-Type"] = "application/json; charset=utf-8"
        req = urllib.request.Request(url, data=data, method=method, headers=headers)
        self.requests_made += 1
        try:
            return self._open(req, method, url)
        finally:
            if method in WRITE_METHODS:
                self._last_write = self.monotonic()  # space from the answer, not the send

    def _open(self, req: urllib.request.Request, method: str, url: str) -> Response:
        try:
            with self._opener.open(req, timeout=self.options.timeout) as fh:
                raw = fh.read()
                hdrs = {k.lower(): v for k, v in fh.headers.items()}
                status = fh.status
        except urllib.error.HTTPError as exc:
            try:
                raw = exc.read()
            except (OSError, ValueError):
                raw = b""
            hdrs = {k.lower(): v for k, v in (exc.headers or {}).items()}
            self._raise_for(method, url, exc.code, hdrs, raw)
            raise AssertionError("unreachable")  # pragma: no cover
        except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise _Retryable(redact(f"{type(exc).__name__}: {reason}", self.token), None) from None
        return Response(status=status, headers=hdrs, data=_decode(raw), url=url)

    def _raise_for(self, method: str, url: str, status: int, hdrs: Mapping[str, str], raw: bytes) -> None:
        payload = _decode_quiet(raw)
        api_msg = redact(str(payload.get("message", "")) if isinstance(payload, dict) else "", self.token)
        where = f"{method} {self._show(url)}"
        if status in (301, 302, 303, 307, 308) and hdrs.get("location"):
            raise _Redirect(hdrs["location"], status)
        if status in (403, 429):
            limit = self._rate_limit_wait(hdrs, api_msg, status)
            if limit is not None:
                raise _RateLimit(limit[0], status, api_msg or f"HTTP {status}", exact=limit[1])
        if status == 401:
            raise Unauthorized(f"{where}: 401 {api_msg or 'Bad credentials'}", status=status, api_message=api_msg,
                               hint="GITHUB_TOKEN is missing, expired or wrong for this GITHUB_API_URL")
        if status == 403:
            raise PermissionDenied(
                f"{where}: 403 {api_msg or 'Forbidden'}", status=status, api_message=api_msg,
                hint="the token cannot write issues here. A pull request from a fork gets a read-only "
                "GITHUB_TOKEN; file issues from scheduled or push runs, and give the job `permissions: issues: write`",
            )
        if status in (404, 410):
            raise NotFound(f"{where}: {status} {api_msg or 'Not Found'}", status=status, api_message=api_msg,
                           hint="check --repo OWNER/NAME and that the token can see that repository")
        if status == 422:
            detail = api_msg
            if isinstance(payload, dict) and payload.get("errors"):
                detail += ": " + redact(json.dumps(payload["errors"])[:500], self.token)
            raise ValidationFailed(f"{where}: 422 {detail or 'Unprocessable Entity'}", status=status, api_message=api_msg,
                                   hint="the request was refused as invalid; the draft is kept")
        if status >= 500 or status == 408:
            raise _Retryable(f"HTTP {status} {api_msg}".strip(), status)
        raise ApiError(f"{where}: HTTP {status} {api_msg}".strip(), status=status, api_message=api_msg)

    def _rate_limit_wait(self, hdrs: Mapping[str, str], api_msg: str, status: int) -> tuple[float, bool] | None:
        """(seconds to wait, whether a header said so) for a rate-limit answer; None when it is not one."""
        retry_after = hdrs.get("retry-after")
        if retry_after is not None:
            try:
                return max(0.0, float(retry_after)), True
            except ValueError:
                pass  # an HTTP date: GitHub sends seconds, fall through to the other signals
        if hdrs.get("x-ratelimit-remaining") == "0":
            try:
                return max(0.0, float(hdrs.get("x-ratelimit-reset", "")) - self.clock()) + 1.0, True
            except ValueError:
                return SECONDARY_LIMIT_MIN_WAIT, False
        if "rate limit" in api_msg.lower() or status == 429:
            return SECONDARY_LIMIT_MIN_WAIT, False
        return None


class _Retryable(Exception):
    def __init__(self, reason: str, status: int | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class _RateLimit(Exception):
    def __init__(self, wait: float, status: int, detail: str, *, exact: bool) -> None:
        super().__init__(detail)
        self.wait = wait
        self.exact = exact  # False: no header said how long; back off exponentially
        self.status = status
        self.detail = detail


class _Redirect(Exception):
    def __init__(self, location: str, status: int) -> None:
        super().__init__(location)
        self.location = location
        self.status = status


def _decode(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ApiError("the API answered with something that is not JSON",
                       hint="check GITHUB_API_URL: it must be the REST API root (…/api/v3 on GHES)") from None


def _decode_quiet(raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8")) if raw else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
