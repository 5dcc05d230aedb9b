"""The contract between the API and the workers: the Celery app, task and queue names, routing
and the job record both sides read. Importing it never imports torch or a model handler."""
