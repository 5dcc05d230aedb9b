"""A job as the API shows it, and the decoding of base64 outputs."""
from __future__ import annotations

import base64
import binascii
import sys
from array import array
from dataclasses import dataclass
from typing import Any

from inference_queue_client.errors import DecodeError, JobFailed, MissingDependency

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "expired"})
BASE64 = "base64"


def decode_float32(text: str) -> list[float]:
    """A vector sent as base64 of little-endian float32 (`encoding_format: "base64"`)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise DecodeError(f"not base64: {exc}") from None
    if len(raw) % 4:
        raise DecodeError(f"{len(raw)} bytes is not a whole number of float32 values")
    values = array("f", raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


def decode_outputs(outputs: list[Any]) -> list[Any]:
    """Each base64 output as its list of floats; other outputs (labels and scores, numbers)
    as they are."""
    decoded = []
    for i, output in enumerate(outputs):
        if isinstance(output, str):
            try:
                output = decode_float32(output)
            except DecodeError as exc:
                raise DecodeError(f"output {i}: {exc}") from None
        decoded.append(output)
    return decoded


@dataclass(frozen=True)
class Job:
    """`body` is the job as the API returned it. `encoding_format` is how its outputs travel:
    the API's word for it when it says, else what the client asked for."""

    body: dict[str, Any]
    encoding_format: str | None = None

    @property
    def id(self) -> str:
        return self.body["id"]

    @property
    def status(self) -> str:
        return self.body["status"]

    @property
    def model(self) -> str | None:
        return self.body.get("model")

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def progress(self) -> dict[str, int] | None:
        """`{"items_done", "items"}`: inputs done (counted while a job spanning several model
        calls runs)."""
        return self.body.get("progress")

    @property
    def error(self) -> dict[str, str] | None:
        """`{"code", "message"}` of a job that failed, was cancelled or expired."""
        return self.body.get("error")

    @property
    def outputs(self) -> list[Any] | None:
        """One output per input, in order, once the job succeeded (else None); base64
        vectors decoded to lists of floats."""
        result = self.body.get("result")
        if result is None:
            return None
        outputs = result.get("outputs", [])
        if (self.body.get("encoding_format") or self.encoding_format) == BASE64:
            return decode_outputs(outputs)
        return outputs

    def result(self) -> list[Any]:
        """The outputs; JobFailed when the job ended any other way than `succeeded`."""
        if self.status != "succeeded":
            raise JobFailed(self)
        return self.outputs or []

    def array(self) -> Any:
        """The outputs as one numpy array (numeric outputs only; JSON's null is NaN)."""
        try:
            import numpy as np
        except ImportError:
            raise MissingDependency("Job.array() needs numpy: pip install "
                                    "'inference-queue-client[numpy]'") from None

        return np.asarray(self.result(), dtype=np.float32)

    def as_dict(self) -> dict[str, Any]:
        """The job as the API showed it, with its outputs decoded (the CLI's output line)."""
        body = dict(self.body)
        if "result" in body:
            body["result"] = {**body["result"], "outputs": self.outputs}
        return body
