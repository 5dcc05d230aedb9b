"""Jobs whose images come as bytes rather than inside JSON:

* `multipart/form-data`: a `job` part holding the job as JSON (model, options, priority, …,
  no inputs) and one file part named `inputs` per image, in input order;
* an `image/*` body: one image; the model (and `priority`, `timeout_s`) in the query string.

Both become the same job dict a JSON body gives, with the images as `bytes` inputs, and go
through the same validation (app/schemas.py) and image checks (app/images.py).
"""
from __future__ import annotations

import json
from typing import Any

from flask import Request

from app.errors import ValidationFailed, json_problem


PARTS = ("job", "inputs")


def _multipart(request: Request) -> dict[str, Any]:
    form, files = request.form, request.files
    # Every part is the job's, or refused: none is dropped unread (a second `job` part, or one
    # of a name the API does not know, was silently ignored).
    problems = {name: ["unknown part: a job is a `job` part and file parts named `inputs`"]
                for name in sorted((set(form) | set(files)) - set(PARTS))}
    if len(form.getlist("job")) > 1 or "job" in files:
        problems["job"] = ["one `job` part, a field (no filename) holding the job as JSON"]
    if "inputs" in form:
        problems["inputs"] = ["images go as file parts named `inputs` (each with a filename); "
                              "texts go in a JSON body"]
    if problems:
        raise ValidationFailed("the job is invalid", fields=problems)
    try:
        job = json.loads(form.get("job") or "{}")
    except (ValueError, RecursionError) as exc:
        # The body is well-formed multipart; one of its fields is not what it must be.
        raise ValidationFailed("the job is invalid", fields={
            "job": [f"the `job` part is not valid JSON: {json_problem(exc)}"]}) from None
    if not isinstance(job, dict):
        raise ValidationFailed("the job is invalid",
                               fields={"job": ["the `job` part must be a JSON object"]})
    images = [part.read() for part in files.getlist("inputs")]
    if images and "inputs" in job:
        raise ValidationFailed("the job is invalid", fields={"inputs": [
            "send the images either as file parts named `inputs` or in the job, not both"]})
    if images:
        job["inputs"] = images
    return job


def _image_body(request: Request) -> dict[str, Any]:
    job: dict[str, Any] = {"model": request.args.get("model"),
                           "inputs": [request.get_data()]}
    for key in ("priority", "timeout_s"):
        if key in request.args:
            job[key] = request.args[key]
    problems = {key: ["unknown query parameter (model, priority, timeout_s)"]
                for key in sorted(set(request.args) - {"model", "priority", "timeout_s"})}
    if "model" not in request.args:
        problems["model"] = ["an image/* body names its model in the query: ?model=<name>"]
    if problems:
        raise ValidationFailed("the job is invalid", fields=problems)
    return job


def job_from_upload(request: Request) -> dict[str, Any] | None:
    """The job of a multipart or image/* request; None for any other content type."""
    if request.mimetype == "multipart/form-data":
        return _multipart(request)
    if request.mimetype.startswith("image/"):
        return _image_body(request)
    return None
