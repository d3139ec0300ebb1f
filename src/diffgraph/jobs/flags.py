"""The batch-job flags of `diffgraph serve` (argparse only, nothing heavy imported: `--help` stays fast). Their
values are read, checked and documented by server/config.py's ServerConfig like every other setting."""

from __future__ import annotations

import argparse

# the ServerConfig fields these flags set (flag --state-dir -> state_dir)
JOB_FIELDS = ("state_dir", "job_retention", "max_batch_items", "max_job_candidates", "max_key_jobs", "max_key_bytes",
              "batch_inflight", "webhook_allow", "webhook_secret")


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="batch jobs (/v1/jobs, `diffgraph batch --url`): keep jobs in DIR/jobs.sqlite3 and their "
                        "images in DIR/images, so they survive restarts; servers sharing DIR on one host share the "
                        "jobs (default: no jobs)")
    p.add_argument("--job-retention", default=None, metavar="TIME",
                   help="how long a finished job and its images are kept: seconds, or 90m, 12h, 7d (default: 7d)")
    p.add_argument("--max-batch-items", type=int, default=None, metavar="N",
                   help="the most items one job may hold (default: 100000)")
    p.add_argument("--max-job-candidates", type=int, default=None, metavar="N",
                   help="the most candidate images one job may hold, all its items' together (a grid's is counted "
                        "before it is expanded; default: 100000)")
    p.add_argument("--max-key-jobs", type=int, default=None, metavar="N",
                   help="unfinished jobs one API key may have at once; more are refused with 429 until one ends "
                        "(default: 16)")
    p.add_argument("--max-key-bytes", type=int, default=None, metavar="BYTES",
                   help="bytes one API key's jobs may keep (their images and rows); past it new jobs are refused "
                        "with 507 until jobs are deleted or expire (default: 274877906944, 256 GiB)")
    p.add_argument("--batch-inflight", type=int, default=None, metavar="N",
                   help="job requests in the engine at once, shared fairly by the API keys, then by their jobs (default: twice the "
                        "largest batch bucket's rows per replica)")
    p.add_argument("--webhook-allow", default=None, metavar="HOSTS",
                   help="hosts job webhooks may call, comma-separated (host or host:port); without it a job naming "
                        "a webhook is refused")
    p.add_argument("--webhook-secret", default=None, metavar="SECRET",
                   help="the HMAC-SHA256 key of the webhooks' X-Diffgraph-Signature header (default: derived from "
                        "the API keys)")
