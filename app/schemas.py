"""Request validation: bad input stops here, with every field at fault named, before it can
reach a queue or a model. The same schemas generate the OpenAPI document (app/openapi.py), so
the two cannot drift.

Refusing is cheap: a list's length is checked before any of its items (100,000 bad inputs
cost one error, not 100,000), and a number a model cannot take (1e300 for float32, 2**70 for
int64) is refused here rather than turned into null or a failure in torch.
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Mapping, NamedTuple
from urllib.parse import urlsplit

from marshmallow import RAISE, Schema, ValidationError, fields, missing, validate

from config.kinds import kind_of
from config.models import ModelSpec
from config.preprocess import IMAGE_FORMATS
from tasks.names import PRIORITIES
from tasks.results import ENCODINGS
from tasks.webhooks import EVENTS

# An Idempotency-Key header: 1 to 255 visible ASCII characters.
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,255}$"

# The numbers each input dtype can hold: (smallest, largest).
NUMBER_RANGES: dict[str, tuple[float | int, float | int]] = {
    "float32": (-3.4028234663852886e38, 3.4028234663852886e38),
    "float64": (-1.7976931348623157e308, 1.7976931348623157e308),
    "int64": (-2**63, 2**63 - 1),
}
# The integers a job's JSON may carry to its task message (orjson's): 64 bits, either sign.
INT_LOW, INT_HIGH = -2**63, 2**64 - 1


class BoundedList(fields.List):
    """A list whose length is checked before its items are; `distinct`: no item twice."""

    def __init__(self, inner: fields.Field, *, min_items: int | None = None,
                 max_items: int | None = None, distinct: bool = False, **kwargs: Any) -> None:
        self.length = validate.Length(min=min_items, max=max_items)
        if distinct:
            kwargs["metadata"] = {**kwargs.get("metadata", {}), "uniqueItems": True}
        super().__init__(inner, validate=[self.length, _distinct] if distinct else self.length,
                         **kwargs)

    def _deserialize(self, value: Any, attr: Any, data: Any, **kwargs: Any) -> Any:
        if isinstance(value, list):
            self.length(value)
        return super()._deserialize(value, attr, data, **kwargs)


def _distinct(values: list) -> None:
    seen: set = set()
    for value in values:
        if value in seen:
            raise ValidationError(f"each item at most once; {value!r} is given twice")
        seen.add(value)


# http(s), a host (a bracketed IPv6 address, or no spaces, `@`, brackets or colons), a port of
# 1 to 65535, then any path, query and fragment without spaces.
_PORT = r"0*(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
WEBHOOK_URL = (r"^[Hh][Tt][Tt][Pp][Ss]?://(\[[0-9A-Fa-f:.]+\]|[^\s/?#@\[\]:]+)"
               rf"(:{_PORT})?([/?#]\S*)?$")


def _http_url(url: str) -> None:
    """What the pattern lets through and a URL parser refuses (a port out of
    range, a broken IPv6 literal) is a field error here, not an exception later."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValidationError("not a valid URL (ports are 1 to 65535)") from None
    if port == 0:
        raise ValidationError("not a valid URL (ports are 1 to 65535)")


class WebhookSchema(Schema):
    class Meta:
        unknown = RAISE

    # The URL's form is what the document's pattern says, so that a webhook the document
    # finds valid is refused only for what no schema can say (its host does not resolve to a
    # public address: app/submission.py). No credentials, as the deliverer never sends them.
    url = fields.String(required=True, validate=[
        validate.Length(max=2048),
        validate.Regexp(WEBHOOK_URL, error="not a valid URL: http:// or https://, a host, no "
                                           "credentials, no spaces"),
        _http_url])
    events = BoundedList(fields.String(validate=validate.OneOf(EVENTS)), min_items=1,
                         max_items=len(EVENTS), distinct=True, load_default=lambda: list(EVENTS))


class JobBase(Schema):
    """What every job has, whatever its model.

    A job is loaded field by field through each field's own `deserialize`, in the schema's
    order, a field the job leaves out given its `load_default` at once (`_Plan`): not through
    marshmallow's general loop, which walks every field, absent or not, through its getter,
    error store and checks of options a job schema never sets (partial, many, data_key,
    attribute, unknown). Whatever that path refuses (an unknown or a missing field, a value a
    field refuses) is loaded again by marshmallow's own `load`, whose errors are the answer: a
    bad job costs at most two loads. The job schemas declare no pre/post-load or `validates`
    hooks, which only marshmallow's own `load` runs (tests/unit/test_schemas.py checks both)."""

    class Meta:
        unknown = RAISE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plan = _Plan.of(self)

    def load(self, data: Any, *, many: bool | None = None, partial: Any = None,
             unknown: str | None = None) -> Any:
        plan = self._plan
        if plan is not None and type(data) is dict and many is None and partial is None \
                and unknown is None and data.keys() <= plan.names:
            try:
                return plan.load(data)
            except ValidationError:
                pass  # marshmallow's own load names every field at fault
        return super().load(data, many=many, partial=partial, unknown=unknown)

    options = fields.Dict(keys=fields.String(), load_default=dict)
    timeout_s = fields.Float(validate=validate.Range(min=0, max=86_400, min_inclusive=False),
                             allow_nan=False, load_default=None)
    priority = fields.String(validate=validate.OneOf(list(PRIORITIES)), load_default="normal")
    webhook = fields.Nested(WebhookSchema, load_default=None)
    # How output vectors come back: numbers, or base64 of little-endian float32 (embeddings).
    encoding_format = fields.String(validate=validate.OneOf(ENCODINGS), load_default="float")


# How `_Plan` takes a field the job leaves out: its load_default as it is, or called; it is
# required (marshmallow's own load names it); or it is left out of the job too.
_AS_IS, _CALLED, _REQUIRED, _LEFT_OUT = range(4)


class _Plan(NamedTuple):
    """A job schema's load (JobBase): each load field's name, `deserialize`, what a job
    that leaves it out gets (_AS_IS..._LEFT_OUT) and its load_default; the names."""
    steps: tuple[tuple[str, Any, int, Any], ...]
    names: frozenset[str]

    @classmethod
    def of(cls, schema: Schema) -> _Plan | None:
        """None for a schema whose load this does not do as marshmallow's does (a schema
        of many, partial, or not making dicts; a field read from another key or stored
        under another name): marshmallow's own load does all of its loads."""
        found = schema.load_fields
        if schema.many or schema.partial not in (None, False) or schema.dict_class is not dict \
                or any(f.data_key is not None or f.attribute is not None
                       for f in found.values()):
            return None
        steps = []
        for name, field in found.items():
            default = field.load_default
            how = _REQUIRED if field.required else _LEFT_OUT if default is missing \
                else _CALLED if callable(default) else _AS_IS
            steps.append((name, field.deserialize, how, default))
        return cls(tuple(steps), frozenset(found))

    def load(self, data: dict) -> dict:
        """`data` loaded as marshmallow's Schema.load loads it, when no field refuses it."""
        out = {}
        for name, deserialize, how, default in self.steps:
            if name in data:
                value = deserialize(data[name], name, data)
                if value is not missing:
                    out[name] = value
            elif how == _AS_IS:
                out[name] = default
            elif how == _CALLED:
                out[name] = default()
            elif how == _REQUIRED:
                raise ValidationError("", name)  # marshmallow's load says it is missing
        return out


class JobEnvelope(JobBase):
    """A job of a model not (yet) known: everything but its inputs and options checked."""
    model = fields.String(required=True)
    inputs = fields.Raw(required=True)


class TensorInput(fields.Field):
    """A nested list of numbers of exactly `shape`, each one the dtype can hold (finite;
    integral for int64)."""

    def __init__(self, shape: tuple[int, ...], dtype: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shape = shape
        self.dtype = dtype
        self.low, self.high = NUMBER_RANGES[dtype]

    def _number(self, value: Any) -> bool:
        """Refuses what the dtype cannot hold; True for an integer past 64 bits, which the
        task message's JSON cannot carry as it is."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValidationError(f"expected a number, got {type(value).__name__}")
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ValidationError("numbers must be finite (no NaN or infinity)")
            if self.dtype == "int64" and not value.is_integer():
                raise ValidationError("this model takes integers")
        # Compared as they are: an int of any size against a float bound never overflows.
        if not self.low <= value <= self.high:
            raise ValidationError(f"numbers must be within {self.dtype}'s range "
                                  f"[{self.low:g}, {self.high:g}]")
        return _wide(value)

    def _check(self, value: Any, depth: int) -> bool:
        if depth == len(self.shape):
            return self._number(value)
        if not isinstance(value, list) or len(value) != self.shape[depth]:
            raise ValidationError(
                f"expected a nested list of shape {list(self.shape)}; "
                f"dimension {depth} must have length {self.shape[depth]}"
            )
        wide = False
        for item in value:
            wide = self._check(item, depth + 1) or wide
        return wide

    def _deserialize(self, value: Any, attr: Any, data: Any, **kwargs: Any) -> Any:
        if self._check(value, 0):
            # A float model's integer past 64 bits (10**38, in float32's range) is the float
            # the model would take: no JSON encoder of the task message takes it as it is.
            return _floated(value)
        return value

    def openapi(self) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "integer" if self.dtype == "int64" else "number",
                                  "minimum": self.low, "maximum": self.high}
        for size in reversed(self.shape):
            schema = {"type": "array", "items": schema, "minItems": size, "maxItems": size}
        schema["description"] = f"a {self.dtype} tensor of shape {list(self.shape)}"
        return schema


def _wide(value: Any) -> bool:
    """An integer past 64 bits: no JSON encoder of the task message takes it as it is."""
    return isinstance(value, int) and not INT_LOW <= value <= INT_HIGH


def _floated(value: Any) -> Any:
    if isinstance(value, list):
        return [_floated(item) for item in value]
    return float(value) if _wide(value) else value


def _encodable(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError("not valid Unicode text (a lone surrogate?)") from None


class ImageInput(fields.Field):
    """A string (base64, a data: URI or an http(s) URL) or uploaded bytes; app/images.py
    decodes and checks the image itself once the whole job is valid."""

    def __init__(self, spec: ModelSpec, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = spec

    def _deserialize(self, value: Any, attr: Any, data: Any, **kwargs: Any) -> Any:
        if isinstance(value, str):
            _encodable(value)
        elif not isinstance(value, bytes):
            raise ValidationError("expected an image: base64, a data: URI, an http(s) URL, "
                                  "or bytes uploaded as multipart or an image/* body")
        if not value:
            raise ValidationError("the image is empty")
        return value

    def openapi(self) -> dict[str, Any]:
        spec = self.spec
        assert spec.preprocess is not None
        height, width = spec.preprocess.size
        return {"type": "string", "minLength": 1, "description": (
            f"an image ({', '.join(IMAGE_FORMATS)}) as base64, a data: URI or an http(s) URL; "
            f"or send the bytes as multipart/form-data or an image/* body. At most "
            f"{spec.max_image_bytes} bytes and {spec.max_image_pixels} pixels; resized and "
            f"cropped to {height}x{width} (height x width) before queueing")}


def _input_field(spec: ModelSpec) -> fields.Field:
    if spec.input_type == "text":
        return fields.String(validate=[validate.Length(max=spec.max_input_chars), _encodable])
    if spec.input_type == "image":
        return ImageInput(spec)
    return TensorInput(spec.input_shape, spec.input_dtype)


def job_schema(spec: ModelSpec) -> Schema:
    """The schema of one model's whole job: its name, its own inputs, limits and options."""
    option_fields: dict[str, fields.Field] = {}
    if "labels" in spec.options:
        option_fields["labels"] = BoundedList(
            fields.String(validate=validate.Length(min=1, max=200)),
            min_items=1, max_items=spec.max_labels, distinct=True)  # a score a label
    if "top_k" in spec.options:
        option_fields["top_k"] = fields.Integer(
            strict=True, validate=validate.Range(min=1, max=max(len(spec.labels), spec.top_k)))
    options = Schema.from_dict(option_fields, name=f"{spec.name}Options")
    job = JobBase.from_dict(
        {
            "model": fields.String(required=True, validate=validate.OneOf([spec.name])),
            "inputs": BoundedList(_input_field(spec), required=True, min_items=1,
                                  max_items=spec.max_inputs),
            "options": fields.Nested(options(unknown=RAISE), load_default=dict),
            # base64 is for vectors: embedding models only.
            "encoding_format": fields.String(
                validate=validate.OneOf(ENCODINGS if kind_of(spec.kind).vectors else ["float"],
                                        error=f"must be one of: {{choices}} for a {spec.kind} "
                                              "model (base64 is for embedding models)"),
                load_default="float"),
        },
        name=f"{spec.name}Job",
    )
    return job()


def flatten(messages: Any, prefix: str = "") -> Iterator[tuple[str, list[str]]]:
    """marshmallow's nested error dict → ("inputs.3", [...]), ("options.labels", [...]), …"""
    if isinstance(messages, Mapping):
        for key, value in messages.items():
            # A nested object's own error (not an object at all) is the field's.
            name = (prefix if key == "_schema" else f"{prefix}.{key}") if prefix else str(key)
            if isinstance(value, list) and all(isinstance(m, str) for m in value):
                yield name, value  # the common leaf, without a generator per field
            else:
                yield from flatten(value, name)
    elif isinstance(messages, list) and all(isinstance(m, str) for m in messages):
        yield prefix or "_schema", messages
    else:
        yield prefix or "_schema", [str(messages)]


# One envelope for every job of a model not known (a schema keeps nothing of a load).
_ENVELOPE = JobEnvelope()
_JOB_FIELDS = frozenset(_ENVELOPE.fields)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate_job(data: Any, models: Mapping[str, ModelSpec],
                 schemas: Mapping[str, Schema]) -> tuple[ModelSpec, dict]:
    """Returns (model, job), or raises ValidationError naming each field at fault."""
    if not isinstance(data, dict):
        raise ValidationError({"_schema": ["expected a JSON object"]})
    if len(data) > len(_JOB_FIELDS):  # some are unknown: name those, and spare marshmallow
        raise ValidationError({k: ["Unknown field."] for k in data if k not in _JOB_FIELDS})
    model = data.get("model")
    spec = models.get(model) if isinstance(model, str) else None
    if spec is None:
        errors: dict[str, Any] = {}
        try:
            _ENVELOPE.load(data)
        except ValidationError as exc:
            errors.update(exc.messages)  # type: ignore[arg-type]
        if "model" not in errors:
            errors["model"] = [f"unknown model {_shown(model)}; "
                               f"known: {', '.join(sorted(models))}"]
        raise ValidationError(errors)
    return spec, schemas[spec.name].load(data)
