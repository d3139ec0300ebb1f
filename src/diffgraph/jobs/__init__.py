"""Batch jobs: job files (spec.py), their durable state (store.py, files.py), the task that runs them
on an engine (coordinator.py, backend.py), completion webhooks (webhook.py) and `diffgraph batch` (cli_batch.py).

Nothing here imports torch: the HTTP process reads, stores and schedules jobs, the engine makes the images. The
routes are server/jobs_routes.py. Importing this package imports none of its modules.
"""
