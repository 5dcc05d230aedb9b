"""The contract between the API and the workers, and only that: the Celery app's
configuration (celery_app; cli, the entry module for `celery -A tasks.cli` and Flower), task
and queue names (names), Redis key names (keys), the job's state machine and its scripts
(jobstate, job_lua), the Lua scripts run inside Redis (lua/, one file each, read by lua),
the task message format (messages), the stored result's format (results), job errors
(errors), webhook signing (webhooks), and what both sides use alike: Redis clients, logging,
traces, outbound HTTP (egress). Importing it never imports torch, a model handler, or anything
of the worker's (workers/broker/ holds kombu's internals)."""
