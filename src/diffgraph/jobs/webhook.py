"""Job webhooks: a job may name a `webhook` URL, called once when it ends (completed, failed or
cancelled) with a JSON summary of it (GET /v1/jobs/ID's answer).

Only hosts on `--webhook-allow` may be called (a comma list of host names or addresses, `host` or `host:port`);
with none, a job naming a webhook is refused when it is made (a 400 naming `webhook`), so a job file can never make
the server send requests to arbitrary addresses. Redirects are not followed (they could lead off the list).

Each call is a POST of the summary, signed: `X-Diffgraph-Signature: sha256=HEX`, the HMAC-SHA256 of the exact body
with the secret (`--webhook-secret`; else derived from the API keys: `webhook_secret`), `X-Diffgraph-Event:
job.completed | job.failed | job.cancelled` and `X-Diffgraph-Delivery: JOB_ID` (the same on every retry and after a
restart: a receiver keeps the IDs it has seen, since a crash between a delivery and its commit sends it again).
Connection errors, timeouts, 429 and 5xx answers are retried with exponential backoff (1, 2, 4, 8 s), at most
`attempts` calls; any other answer ends it (2xx: sent; 4xx: failed, with the status in the job's webhook_error).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from typing import Any
from urllib.parse import urlsplit

SIGNATURE_HEADER = "X-Diffgraph-Signature"


class WebhookRefused(ValueError):
    """A webhook URL this server may not call (one line saying why and what to do)."""


def webhook_secret(secret: str | None, keys: tuple[str, ...]) -> bytes | None:
    """The signing secret: --webhook-secret, else one derived from the API keys (sha256 of "diffgraph webhooks\\n" and
    the keys sorted, one a line, as hex: receivers holding the keys can compute it), else None."""
    if secret:
        return secret.encode()
    if keys:
        return hashlib.sha256(b"diffgraph webhooks\n" + "\n".join(sorted(keys)).encode()).hexdigest().encode()
    return None


def sign(secret: bytes, body: bytes) -> str:
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def check_webhook(url: str, allow: tuple[str, ...]) -> str:
    """`url` when it may be called (http or https, a host on the allow list), else WebhookRefused."""
    if not allow:
        raise WebhookRefused("webhooks are off on this server; start it with --webhook-allow HOST (the hosts jobs "
                             "may call), or leave webhook out")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise WebhookRefused(f"webhook {url[:80]!r} is not a URL; give one such as https://hooks.example.com/done") \
            from None
    bad = next((ch for ch in url if ch < " " or ch == "\x7f" or "\ud800" <= ch <= "\udfff"), None)
    if bad is not None:  # httpx refuses to send to it: the job would end with its webhook never called
        raise WebhookRefused(f"webhook {url[:80]!r} holds the character {bad!r}, which a URL cannot carry; "
                             "percent-encode it or leave it out")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookRefused(f"webhook {url[:80]!r} must be an http or https URL with a host")
    if parts.username or parts.password:
        raise WebhookRefused("webhook URLs may not carry credentials; the calls are signed with the webhook secret")
    host = parts.hostname.lower()
    if host not in allow and f"{host}:{port or (443 if parts.scheme == 'https' else 80)}" not in allow:
        raise WebhookRefused(f"webhook host {host!r} is not allowed; this server calls only {', '.join(allow)} "
                             "(--webhook-allow)")
    return url


class WebhookSender:
    """Delivers completion calls: `deliver` returns None when one was answered 2xx, else the reason it failed."""

    def __init__(self, allow: tuple[str, ...], secret: bytes | None, attempts: int = 5, backoff_s: float = 1.0,
                 timeout_s: float = 10.0):
        self.allow, self.secret = allow, secret
        self.attempts, self.backoff_s, self.timeout_s = attempts, backoff_s, timeout_s

    async def deliver(self, url: str, summary: dict[str, Any]) -> str | None:
        import httpx

        try:
            check_webhook(url, self.allow)  # the list may have changed since the job was made
        except WebhookRefused as e:
            return str(e)
        body = json.dumps(summary, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "diffgraph-webhooks",
                   "X-Diffgraph-Event": f"job.{summary.get('status')}", "X-Diffgraph-Delivery": str(summary.get("id"))}
        if self.secret is not None:
            headers[SIGNATURE_HEADER] = sign(self.secret, body)
        error = "not attempted"
        async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False, trust_env=False) as client:
            for attempt in range(self.attempts):
                if attempt:
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    response = await client.post(url, content=body, headers=headers)
                except httpx.InvalidURL as e:  # not an httpx.HTTPError; calling again cannot help
                    return f"the webhook URL cannot be called: {e}"
                except httpx.HTTPError as e:
                    error = f"{type(e).__name__}: {e}"
                    continue
                if 200 <= response.status_code < 300:
                    return None
                error = f"the webhook answered {response.status_code}"
                if response.status_code != 429 and response.status_code < 500:
                    return error
        return f"{error} (after {self.attempts} attempts)"
