"""The webhook delivery task, run by a light worker on the `iq.webhooks` queue
(`scripts/webhooks.sh`): POST, signed; retried with exponential backoff on errors and 5xx."""
from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from typing import Any

from celery import Celery

from tasks.logs import trace
from tasks.webhooks import DELIVER_TASK, WebhookRefused, check_url, headers

logger = logging.getLogger(__name__)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # A redirect could lead to an address check_url never saw.
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_opener = urllib.request.build_opener(_NoRedirect)


def register(app: Celery) -> None:
    settings = app.conf.iq_settings
    allow = settings.webhook_allow_list

    @app.task(name=DELIVER_TASK, bind=True, acks_late=True, max_retries=settings.webhook_retries,
              shared=False)
    def deliver(self, url: str, event: str, job_id: str, payload: dict,
                trace_id: str | None = None) -> int:
        with trace(trace_id):
            try:
                check_url(url, allow)  # again: DNS may have changed since the job was accepted
            except WebhookRefused as exc:
                logger.warning("webhook for job %s refused: %s", job_id, exc)
                return 0
            body = json.dumps(payload).encode()
            request = urllib.request.Request(
                url, data=body, method="POST",
                headers=headers(settings.webhook_secret, event, job_id, body))
            try:
                with _opener.open(request, timeout=settings.webhook_timeout_s) as response:
                    status = response.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            except (urllib.error.URLError, OSError) as exc:
                status = 0
                logger.warning("webhook for job %s failed: %s", job_id, exc)
            if 200 <= status < 300:
                logger.info("webhook %s for job %s delivered (%d)", event, job_id, status)
                return status
            if status and 400 <= status < 500 and status not in (408, 429):
                logger.warning("webhook for job %s refused by receiver (%d); not retried",
                               job_id, status)
                return status
            countdown = settings.webhook_backoff_s * (2 ** self.request.retries)
            logger.info("webhook for job %s answered %s; retry %d in %.1fs", job_id,
                        status or "nothing", self.request.retries + 1, countdown)
            raise self.retry(countdown=countdown)
