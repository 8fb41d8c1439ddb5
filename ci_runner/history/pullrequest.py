"""`baseline propose --pr`: open or update one pull request with the proposed baseline, through the REST API.

Git data endpoints, so a baseline over the Contents API's 1 MB limit still goes through:

1. ``GET /repos/R`` (the default branch, unless ``--base``), ``GET /repos/R/git/ref/heads/BASE``,
   ``GET /repos/R/git/commits/SHA`` (its tree);
2. ``POST /repos/R/git/blobs`` (the file), ``POST /repos/R/git/trees`` (on the base tree),
   ``POST /repos/R/git/commits`` (one commit on the base);
3. the proposal branch (``deepview-ci/baseline-update``) is created, or moved to that commit: it is the
   tool's own branch and always holds exactly one proposal on top of the base;
4. ``GET /repos/R/pulls?head=OWNER:BRANCH&state=open``: the open pull request is updated, else one is created.

The token needs ``contents: write`` and ``pull-requests: write`` for this step.
"""

from __future__ import annotations

import base64
import urllib.parse
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError
from ..github.client import DEFAULT_API_URL, ClientOptions, GitHubClient, NotFound

TITLE = "deepview-ci: baseline update proposed from the run history"


def _q(ref: str) -> str:
    return urllib.parse.quote(ref, safe="/")


def propose_pr(client: GitHubClient, repo: str, *, path: str, content: bytes, body: str, branch: str,
               base: str | None = None) -> str:
    """Commit `content` at `path` on `branch` (one commit on `base`) and open or update its pull request."""
    base = base or client.get(f"/repos/{repo}").data["default_branch"]
    base_sha = client.get(f"/repos/{repo}/git/ref/heads/{_q(base)}").data["object"]["sha"]
    tree = client.get(f"/repos/{repo}/git/commits/{base_sha}").data["tree"]["sha"]
    blob = client.post(f"/repos/{repo}/git/blobs", {"content": base64.b64encode(content).decode("ascii"),
                                                    "encoding": "base64"}).data["sha"]
    new_tree = client.post(f"/repos/{repo}/git/trees", {"base_tree": tree, "tree": [
        {"path": path, "mode": "100644", "type": "blob", "sha": blob}]}).data["sha"]
    commit = client.post(f"/repos/{repo}/git/commits", {"message": TITLE + "\n\n" + body[:60000], "tree": new_tree,
                                                        "parents": [base_sha]}).data["sha"]
    try:
        client.get(f"/repos/{repo}/git/ref/heads/{_q(branch)}")
        client.patch(f"/repos/{repo}/git/refs/heads/{_q(branch)}", {"sha": commit, "force": True})
    except NotFound:
        client.post(f"/repos/{repo}/git/refs", {"ref": f"refs/heads/{branch}", "sha": commit})
    owner = repo.split("/", 1)[0]
    open_prs = list(client.paginate(f"/repos/{repo}/pulls", {"head": f"{owner}:{branch}", "state": "open"}))
    if open_prs:
        pr = client.patch(f"/repos/{repo}/pulls/{open_prs[0]['number']}", {"title": TITLE, "body": body}).data
        return f"updated pull request #{pr['number']}: {pr.get('html_url', '')}"
    pr = client.post(f"/repos/{repo}/pulls", {"title": TITLE, "head": branch, "base": base, "body": body}).data
    return f"opened pull request #{pr['number']}: {pr.get('html_url', '')}"


def open_pr(args: Any, out: Path, summary: str, env: Mapping[str, str], options: ClientOptions | None = None) -> str:
    """The `--pr` step of `baseline propose`: token and API from the environment, like `file-issues`."""
    repo = args.repo or env.get("GITHUB_REPOSITORY", "")
    if "/" not in repo:
        raise ConfigError("baseline propose --pr: no repository", hint="pass --repo OWNER/NAME (in Actions: GITHUB_REPOSITORY)")
    token = (env.get("GITHUB_TOKEN") or "").strip()
    if not token:
        raise ConfigError("baseline propose --pr: GITHUB_TOKEN is not set",
                          hint="give the step a token with `contents: write` and `pull-requests: write`")
    client = GitHubClient(env.get("GITHUB_API_URL") or DEFAULT_API_URL, token, options or ClientOptions())
    path = Path(args.path or args.baseline).as_posix().removeprefix("./").lstrip("/")
    return propose_pr(client, repo, path=path, content=Path(out).read_bytes(), body=summary, branch=args.pr_branch,
                      base=args.base)
