"""GitHub integration.

- `actions`: the Actions environment (step outputs, step summary, annotations).
- `client`: a small REST client on urllib (token auth, Link pagination, rate limits, retries).
- `issues`: `deepview-ci file-issues`, deduplicated issues for new failing operators and layers.
"""
