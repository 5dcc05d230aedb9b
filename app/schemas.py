"""Request validation: bad input stops here, with every field at fault named, before it can
reach a queue or a model."""
from __future__ import annotations

import math
from typing import Any, Mapping

from marshmallow import RAISE, Schema, ValidationError, fields, validate

from config.models import ModelSpec
from tasks.names import PRIORITIES
from tasks.results import ENCODINGS
from tasks.webhooks import EVENTS


class WebhookSchema(Schema):
    class Meta:
        unknown = RAISE

    url = fields.Url(required=True, schemes={"http", "https"}, require_tld=False,
                     validate=validate.Length(max=2048))
    events = fields.List(fields.String(validate=validate.OneOf(EVENTS)),
                         validate=validate.Length(min=1), load_default=lambda: list(EVENTS))


class JobEnvelope(Schema):
    class Meta:
        unknown = RAISE

    model = fields.String(required=True)
    inputs = fields.Raw(required=True)
    options = fields.Dict(keys=fields.String(), load_default=dict)
    timeout_s = fields.Float(validate=validate.Range(min=0, max=86_400, min_inclusive=False),
                             allow_nan=False, load_default=None)
    priority = fields.String(validate=validate.OneOf(list(PRIORITIES)), load_default="normal")
    webhook = fields.Nested(WebhookSchema, load_default=None)
    # How output vectors come back: numbers, or base64 of little-endian float32 (embeddings).
    encoding_format = fields.String(validate=validate.OneOf(ENCODINGS), load_default="float")


class TensorInput(fields.Field):
    """A nested list of numbers of exactly `shape`; finite, and integral for int64 models."""

    def __init__(self, shape: tuple[int, ...], dtype: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shape = shape
        self.integral = dtype == "int64"

    def _check(self, value: Any, depth: int) -> None:
        if depth == len(self.shape):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValidationError(f"expected a number, got {type(value).__name__}")
            if not math.isfinite(value):
                raise ValidationError("numbers must be finite (no NaN or infinity)")
            if self.integral and not float(value).is_integer():
                raise ValidationError("this model takes integers")
            return
        if not isinstance(value, list) or len(value) != self.shape[depth]:
            raise ValidationError(
                f"expected a nested list of shape {list(self.shape)}; "
                f"dimension {depth} must have length {self.shape[depth]}"
            )
        for item in value:
            self._check(item, depth + 1)

    def _deserialize(self, value: Any, attr: Any, data: Any, **kwargs: Any) -> Any:
        self._check(value, 0)
        return value


def _encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError("not valid Unicode text (a lone surrogate?)") from None


class ImageInput(fields.Field):
    """A string (base64, a data: URI or an http(s) URL) or uploaded bytes; app/images.py
    decodes and checks the image itself once the whole job is valid."""

    def _deserialize(self, value: Any, attr: Any, data: Any, **kwargs: Any) -> Any:
        if isinstance(value, str):
            _encodable(value)
        elif not isinstance(value, bytes):
            raise ValidationError("expected an image: base64, a data: URI, an http(s) URL, "
                                  "or bytes uploaded as multipart or an image/* body")
        if not value:
            raise ValidationError("the image is empty")
        return value


def _input_field(spec: ModelSpec) -> fields.Field:
    if spec.input_type == "text":
        return fields.String(validate=[validate.Length(max=spec.max_input_chars), _encodable])
    if spec.input_type == "image":
        return ImageInput()
    return TensorInput(spec.input_shape, spec.input_dtype)


def job_schema(spec: ModelSpec) -> Schema:
    """The schema of one model's `inputs` and `options`."""
    option_fields: dict[str, fields.Field] = {}
    if spec.kind == "classification":
        option_fields["labels"] = fields.List(
            fields.String(validate=validate.Length(min=1, max=200)),
            validate=validate.Length(min=1, max=spec.max_labels),
        )
    if "top_k" in spec.options:
        option_fields["top_k"] = fields.Integer(
            strict=True, validate=validate.Range(min=1, max=max(len(spec.labels), spec.top_k)))
    options_schema = Schema.from_dict(option_fields, name=f"{spec.name}Options")
    job = Schema.from_dict(
        {
            "inputs": fields.List(
                _input_field(spec), required=True,
                validate=validate.Length(min=1, max=spec.max_inputs),
            ),
            "options": fields.Nested(options_schema(unknown=RAISE), load_default=dict),
        },
        name=f"{spec.name}Job",
    )
    return job(unknown=RAISE)


def flatten(messages: Any, prefix: str = "") -> dict[str, list[str]]:
    """marshmallow's nested error dict → {"inputs.3": [...], "options.labels": [...]}."""
    if isinstance(messages, Mapping):
        out: dict[str, list[str]] = {}
        for key, value in messages.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            out.update(flatten(value, name))
        return out
    if isinstance(messages, list) and all(isinstance(m, str) for m in messages):
        return {prefix or "_schema": messages}
    return {prefix or "_schema": [str(messages)]}


def validate_job(data: Any, models: Mapping[str, ModelSpec],
                 schemas: Mapping[str, Schema]) -> tuple[ModelSpec, dict]:
    """Returns (model, {"inputs", "options"}), or raises ValidationError naming each field."""
    if not isinstance(data, dict):
        raise ValidationError({"_schema": ["expected a JSON object"]})
    errors: dict[str, Any] = {}
    try:
        envelope = JobEnvelope().load(data)
    except ValidationError as exc:
        errors.update(exc.messages)  # type: ignore[arg-type]
        envelope = {k: data.get(k) for k in ("model", "inputs", "options") if k in data}
    model = envelope.get("model")
    spec = models.get(model) if isinstance(model, str) else None
    if spec is None:
        if "model" not in errors:
            errors["model"] = [f"unknown model {model!r}; known: {', '.join(sorted(models))}"]
        raise ValidationError(errors)
    try:
        job = schemas[spec.name].load(
            {"inputs": envelope.get("inputs"), "options": envelope.get("options") or {}}
        )
    except ValidationError as exc:
        for key, value in exc.messages.items():  # type: ignore[union-attr]
            errors.setdefault(key, value)
    encoding = envelope.get("encoding_format") or "float"
    if encoding == "base64" and spec.kind != "embedding":
        errors.setdefault("encoding_format", [
            f"base64 is for embedding models; {spec.name} is a {spec.kind} model"])
    if errors:
        raise ValidationError(errors)
    job["encoding_format"] = encoding
    job["timeout_s"] = envelope.get("timeout_s")
    job["priority"] = envelope.get("priority") or "normal"
    job["webhook"] = envelope.get("webhook")
    return spec, job
