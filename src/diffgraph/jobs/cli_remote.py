"""`diffgraph batch FILE --out DIR --url URL`: the candidates not yet in DIR sent as one job to a server
(POST /v1/jobs, each with its seed), followed (GET /v1/jobs/ID every POLL_S) and downloaded into DIR as they are
made (GET /v1/jobs/ID/results, then each image's URL). No torch: the server validates and makes the images.

What an image must carry to be kept on a re-run is computed with the server's defaults (GET /info: its model, size,
guidance, sampler and schedule); the prompt syntax and clip skip an item leaves to the server's own settings are
not compared (nor, then, the LoRAs an a1111-syntax prompt's tags add). The job's ID is kept in DIR's manifest: after
Ctrl-C (the job goes on on the server) the same command follows the same job again instead of making a new one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

from ..capability_settings import builtin_params
from .batch_work import MANIFEST, Tally, Work, already_there, plan

if TYPE_CHECKING:
    import httpx

    from ..cli_progress import Progress
    from ..request import ModelInfo
    from .spec import JobSpec

POLL_S = 1.0
PAGE = 500  # items of the results read at a time


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key:
        return args.api_key
    keys = [k.strip() for k in os.environ.get("DIFFGRAPH_API_KEY", "").split(",") if k.strip()]
    return keys[0] if keys else None


def _answer(response: httpx.Response, url: str, todo: list[Work] | None = None) -> dict[str, Any]:
    """The JSON of a 200, else a ValueError in the server's words (an item of the sent job named as the file's)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code == 200 and isinstance(body, dict):
        return body
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str):
        raise ValueError(f"the server at {url} answered {response.status_code} {response.reason_phrase}")
    if todo is not None:  # "items[3]: ..." of the job sent -> the file's item and candidate
        message = re.sub(r"^items\[(\d+)\]", lambda m: f"item {todo[int(m.group(1))].item}"
                         if int(m.group(1)) < len(todo) else m.group(0), message)
    if response.status_code == 401:
        raise ValueError(f"{message}; give --api-key KEY or set DIFFGRAPH_API_KEY")
    raise ValueError(message if response.status_code == 400 else
                     f"the server at {url} answered {response.status_code}: {message}")


def _model_info(body: dict[str, Any], url: str) -> ModelInfo:
    from ..request import ModelInfo

    if not body.get("ready") or body.get("native_size") is None:
        raise ValueError(f"the server at {url} is not ready (its model is loading); retry when GET {url}/ready "
                         "answers 200")
    return ModelInfo(name=body["model"], family=body["family"], native_size=body["native_size"],
                     default_guidance=body["default_guidance"], max_rows=body["max_images"], mode=body["mode"],
                     device="remote", samplers=tuple(body["samplers"]), schedules=tuple(body["schedules"]),
                     default_sampler=body["default_sampler"], default_schedule=body["default_schedule"],
                     size_multiple=body["size_multiple"], guidance=body.get("guidance") or "cfg",
                     default_steps=body.get("default_steps"),
                     extension_params=tuple(body.get("extension_params") or ()),
                     extension_images=tuple(body.get("extension_images") or ()))


def _server_settings(body: dict[str, Any]) -> tuple[str, ...]:
    """The fields an item leaves to the server's own settings (not known here, so not compared)."""
    left = tuple(k for k in ("prompt_syntax", "clip_skip") if k not in body)
    tagged = "<lora:" in f"{body.get('prompt')}{body.get('negative_prompt')}"
    return left + (("loras",) if "prompt_syntax" not in body and tagged else ())


def _remember(out: str, job: dict[str, str] | None) -> None:
    from .files import write_image

    path = os.path.join(out, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        manifest = {}
    manifest["job"] = job
    write_image(path, json.dumps(manifest).encode(), "--out")


def _kept_job(out: str, url: str, digest: str) -> str | None:
    try:
        with open(os.path.join(out, MANIFEST), encoding="utf-8") as f:
            job = json.load(f).get("job") or {}
    except (OSError, ValueError, AttributeError):
        return None
    return job.get("id") if job.get("url") == url and job.get("digest") == digest else None


def run_remote(args: argparse.Namespace, read: Callable[[Any], JobSpec], out: str, progress: Progress) -> Tally | None:
    """Makes the job's missing images on the server at --url; None when interrupted (the job goes on there)."""
    import httpx

    from ..api.config import ServerConfig

    url = args.url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url {args.url!r} must look like http://HOST:PORT")
    key = _api_key(args)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(120.0, connect=10.0)) as client:
            progress.phase(f"asking {url}")
            info = _model_info(_answer(client.get("/info"), url), url)
            spec = read(None, info.extension_params or builtin_params())  # the server checks the items against its model
            tally = Tally(spec, progress)
            todo = already_there(plan(spec, ServerConfig(model=info.name), info, out, _server_settings), tally)
            if not todo:
                return tally
            body = json.dumps({"items": [{**w.body, "seeds": [w.seed]} for w in todo],
                               "name": os.path.basename(args.file)}).encode()
            digest = hashlib.sha256(body).hexdigest()
            job = _kept_job(out, url, digest)
            if job is not None and client.get(f"/v1/jobs/{job}").status_code != 200:
                job = None  # deleted, expired, or another server
            if job is None:
                job = _answer(client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"}),
                              url, todo)["id"]
                _remember(out, {"id": job, "url": url, "digest": digest})
            try:
                _follow(client, url, job, todo, tally)
            except KeyboardInterrupt:
                print(f"\nthe job {job} goes on on the server; run the same command again to follow it (POST "
                      f"{url}/v1/jobs/{job}/cancel stops it)", file=sys.stderr)
                return None
            _remember(out, None)
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        raise ValueError(f"the server at {url} could not be reached ({e}); start it with `diffgraph serve "
                         "--state-dir DIR` or check --url") from None
    except httpx.HTTPError as e:
        raise ValueError(f"the request to the server at {url} failed: {e}") from None
    return tally


def _follow(client: httpx.Client, url: str, job: str, todo: list[Work], tally: Tally) -> None:
    """Polls the job until it ends, downloading each image once it is made."""
    from .files import ImageWriteError, write_image
    from .store import UNFINISHED

    settled = [False] * len(todo)
    first = 0  # the first candidate not yet downloaded or failed: results are read from there
    while True:
        summary = _answer(client.get(f"/v1/jobs/{job}"), url)
        status = summary["status"]
        ended = status not in UNFINISHED
        if status == "paused":  # the server's disk is full: it resumes by itself once there is space
            tally.progress.phase(f"paused on the server: {summary.get('reason')}; waiting")
        offset = first
        while offset < len(todo):
            page = _answer(client.get(f"/v1/jobs/{job}/results", params={"offset": offset, "limit": PAGE}), url)
            settled_here = 0
            for entry in page["data"]:
                j, w = entry["item"], todo[entry["item"]]
                if settled[j] or entry["status"] == "pending":
                    continue
                settled[j], settled_here = True, settled_here + 1
                if entry["status"] != "done":
                    tally.fail(w.item, w.k, entry.get("error") or f"the job was {status} on the server")
                    continue
                image = client.get(entry["images"][0])
                if image.status_code != 200:
                    tally.fail(w.item, w.k, f"its image could not be downloaded ({image.status_code})")
                    continue
                try:
                    write_image(w.path, image.content, "--out")
                    tally.done(w.item)
                except ImageWriteError as e:
                    tally.fail(w.item, w.k, str(e))
            offset += len(page["data"])
            if not page["has_more"] or not settled_here:
                break
        while first < len(todo) and settled[first]:
            first += 1
        if first == len(todo):
            return
        if ended:
            for j, w in enumerate(todo):
                if not settled[j]:
                    tally.fail(w.item, w.k, f"the job was {status} on the server before this image was made")
            return
        time.sleep(POLL_S)
