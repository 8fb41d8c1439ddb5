"""The REST client against the local fake GitHub: auth, pagination, rate limits, retries, spacing."""

from __future__ import annotations

import time

import pytest

from ci_runner.github.client import (
    ClientOptions,
    GitHubClient,
    PermissionDenied,
    RateLimited,
    ServerUnavailable,
    Unauthorized,
    ValidationFailed,
    parse_link_header,
    redact,
)
from ci_runner.errors import GitHubError
from tests.fixtures.fake_github import SECONDARY_MESSAGE, FakeGitHub

FAST = ClientOptions(timeout=5, max_retries=3, backoff=0.0, max_wait=10, min_write_interval=0.0)


def client(gh: FakeGitHub, **kw) -> GitHubClient:
    opts = ClientOptions(**{**FAST.__dict__, **kw})
    return GitHubClient(gh.url, gh.token, opts)


def test_parse_link_header_github_format():
    value = ('<https://api.github.com/repositories/1300192/issues?page=2>; rel="prev", '
             '<https://api.github.com/repositories/1300192/issues?page=4>; rel="next", '
             '<https://api.github.com/repositories/1300192/issues?page=515>; rel="last", '
             '<https://api.github.com/repositories/1300192/issues?page=1>; rel="first"')
    links = parse_link_header(value)
    assert links["next"].endswith("page=4")
    assert links["prev"].endswith("page=2")
    assert links["last"].endswith("page=515")
    assert links["first"].endswith("page=1")
    assert parse_link_header(None) == {}
    assert parse_link_header("") == {}


def test_pagination_follows_link_header_across_pages(gh):
    for i in range(7):
        gh.add_label("acme/models", f"label-{i:02d}")
    c = client(gh)
    names = [lab["name"] for lab in c.paginate("/repos/acme/models/labels", {"per_page": 3})]
    assert names == [f"label-{i:02d}" for i in range(7)]
    pages = [r.query.get("page", ["1"])[0] for r in gh.requests if r.path.endswith("/labels")]
    assert pages == ["1", "2", "3"]


def test_pagination_never_leaves_the_api_host(gh):
    gh.add_label("acme/models", "a")
    gh.fail("GET", r"/labels$", status=200, body=[{"name": "a"}], headers={"link": '<http://evil.example/steal?page=2>; rel="next"'})
    c = client(gh)
    assert [lab["name"] for lab in c.paginate("/repos/acme/models/labels")] == ["a"]
    assert len(gh.requests) == 1


def test_bearer_token_auth_and_401_without_token_in_message(gh):
    c = client(gh)
    c.get("/repos/acme/models/labels")
    assert gh.requests[-1].auth == "bearer"
    bad = GitHubClient(gh.url, "ghp_WRONGtoken_secret_value", FAST)
    with pytest.raises(Unauthorized) as info:
        bad.get("/repos/acme/models/labels")
    assert "ghp_WRONGtoken_secret_value" not in str(info.value)
    assert "ghp_WRONGtoken_secret_value" not in repr(bad)
    assert info.value.status == 401 and isinstance(info.value, GitHubError)


def test_readonly_token_403_is_permission_not_rate_limit(gh):
    gh.readonly_tokens.add("ghs_readonly_fork_token")
    c = GitHubClient(gh.url, "ghs_readonly_fork_token", FAST)
    c.get("/repos/acme/models/labels")  # reads work
    with pytest.raises(PermissionDenied) as info:
        c.post("/repos/acme/models/issues", {"title": "x", "body": "y"})
    assert "fork" in (info.value.hint or "")
    assert len(gh.writes()) == 1  # not retried
    assert c.waits == []


def test_secondary_rate_limit_retry_after_is_honoured(gh):
    gh.fail("POST", r"/issues$", status=403, headers={"retry-after": "1"}, body={"message": SECONDARY_MESSAGE})
    c = client(gh)
    start = time.monotonic()
    resp = c.post("/repos/acme/models/issues", {"title": "t", "body": "b"})
    assert resp.status == 201
    assert time.monotonic() - start >= 1.0
    first, second = gh.writes()
    assert second.at - first.at >= 1.0
    assert c.waits == [1.0]
    assert len(gh.issues()) == 1


def test_primary_rate_limit_waits_until_reset(gh):
    reset = int(time.time()) + 1
    gh.fail("GET", r"/labels$", status=403, body={"message": "API rate limit exceeded"},
            headers={"x-ratelimit-remaining": "0", "x-ratelimit-reset": str(reset)})
    c = client(gh)
    c.get("/repos/acme/models/labels")
    assert len(c.waits) == 1 and 0.5 <= c.waits[0] <= 3.0
    assert len(gh.requests) == 2 and time.time() >= reset


def test_secondary_limit_without_headers_backs_off_at_least_a_minute(gh):
    gh.fail("POST", r"/issues$", status=403, body={"message": SECONDARY_MESSAGE},
            headers={"x-ratelimit-remaining": "4000"})
    slept: list[float] = []
    c = GitHubClient(gh.url, gh.token, ClientOptions(**{**FAST.__dict__, "max_wait": 600}), sleep=slept.append)
    c.post("/repos/acme/models/issues", {"title": "t", "body": "b"})
    assert slept == [60.0]


def test_rate_limit_wait_is_bounded_by_max_wait(gh):
    gh.fail("POST", r"/issues$", status=429, headers={"retry-after": "3600"}, body={"message": SECONDARY_MESSAGE})
    c = client(gh, max_wait=5)
    start = time.monotonic()
    with pytest.raises(RateLimited) as info:
        c.post("/repos/acme/models/issues", {"title": "t", "body": "b"})
    assert time.monotonic() - start < 1.0
    assert "3600" in str(info.value) and c.waits == []
    assert gh.issues() == []


def test_repeated_rate_limits_give_up_after_max_retries(gh):
    gh.fail("GET", r"/labels$", status=403, headers={"retry-after": "0"}, body={"message": SECONDARY_MESSAGE}, times=10)
    c = client(gh, max_retries=2)
    with pytest.raises(RateLimited):
        c.get("/repos/acme/models/labels")
    assert len(gh.requests) == 3


def test_5xx_is_retried_with_backoff_for_reads(gh):
    gh.fail("GET", r"/labels$", status=502, body={"message": "Server Error"}, times=2)
    slept: list[float] = []
    c = GitHubClient(gh.url, gh.token, ClientOptions(**{**FAST.__dict__, "backoff": 0.5}), sleep=slept.append)
    assert c.get("/repos/acme/models/labels").status == 200
    assert slept == [0.5, 1.0]
    assert len(gh.requests) == 3


def test_5xx_gives_up_after_max_retries(gh):
    gh.fail("GET", r"/labels$", status=503, times=99)
    c = client(gh, max_retries=2)
    with pytest.raises(ServerUnavailable) as info:
        c.get("/repos/acme/models/labels")
    assert not info.value.uncertain
    assert len(gh.requests) == 3


def test_post_is_not_blindly_retried_after_5xx(gh):
    gh.fail("POST", r"/issues$", status=502, after=True)
    c = client(gh)
    with pytest.raises(ServerUnavailable) as info:
        c.post("/repos/acme/models/issues", {"title": "t", "body": "b"})
    assert info.value.uncertain
    assert len(gh.writes()) == 1 and len(gh.issues()) == 1  # GitHub may well have created it


def test_timeout_is_retried(gh):
    gh.fail("GET", r"/labels$", status=200, body=[], delay=1.0)
    c = client(gh, timeout=0.3)
    start = time.monotonic()
    assert c.get("/repos/acme/models/labels").status == 200
    assert len(gh.requests) == 2
    assert time.monotonic() - start < 5


def test_422_is_validation_failed_and_not_fatal(gh):
    c = client(gh)
    with pytest.raises(ValidationFailed) as info:
        c.post("/repos/acme/models/issues", {"title": "t", "body": "x" * 65537})
    assert not info.value.fatal
    assert "too long" in str(info.value)


def test_writes_are_spaced(gh):
    gh.write_interval = 0.25  # the fake answers closer writes with a secondary rate limit
    c = client(gh, min_write_interval=0.25)
    for i in range(3):
        c.post("/repos/acme/models/issues", {"title": f"t{i}", "body": "b"})
    w = gh.writes()
    assert [r.status for r in w] == [201, 201, 201]
    assert all(b.at - a.at >= 0.25 for a, b in zip(w, w[1:]))


def test_ghes_api_url_with_path_prefix():
    with FakeGitHub(prefix="/api/v3") as ghes:
        for i in range(3):
            ghes.add_label("acme/models", f"l{i}")
        c = GitHubClient(ghes.url + "/", ghes.token, FAST)
        assert c.api_url.endswith("/api/v3")
        assert len(list(c.paginate("/repos/acme/models/labels", {"per_page": 2}))) == 3


def test_bad_api_url_is_refused():
    with pytest.raises(GitHubError):
        GitHubClient("ftp://example.com", "t")


def test_redact():
    assert redact("token ghs_abc123 leaked ghs_abc123", "ghs_abc123") == "token *** leaked ***"
    assert redact("nothing", "") == "nothing"
