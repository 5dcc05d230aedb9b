"""A client for the inference-queue HTTP API: submit jobs, wait for them, read and cancel them,
from Python (`Client`) or the shell (`iq-client`, or `python -m inference_queue_client`).

    from inference_queue_client import Client

    with Client() as iq:            # IQ_API_URL, else 127.0.0.1:<IQ_PORT>, else :8000
        vectors = iq.run("minilm-embed", ["hello world", "how are you"])
"""
from inference_queue_client.client import Client, JobEvent
from inference_queue_client.errors import (APIError, ConfigurationError, Conflict,
                                           ConnectionFailed, DecodeError, Forbidden,
                                           InvalidRequest, IQError, JobFailed,
                                           MalformedRequest, MethodNotAllowed,
                                           MissingDependency, NotFound, Overloaded,
                                           PayloadTooLarge, RateLimited, Unauthorized,
                                           Unavailable, UnsupportedMediaType, ValidationError,
                                           WaitTimeout)
from inference_queue_client.jobs import Job, decode_float32, decode_outputs

__all__ = ["APIError", "Client", "ConfigurationError", "Conflict", "ConnectionFailed",
           "DecodeError", "Forbidden", "IQError", "InvalidRequest", "Job", "JobEvent",
           "JobFailed", "MalformedRequest", "MethodNotAllowed", "MissingDependency", "NotFound",
           "Overloaded", "PayloadTooLarge", "RateLimited", "Unauthorized", "Unavailable",
           "UnsupportedMediaType", "ValidationError", "WaitTimeout", "decode_float32",
           "decode_outputs"]
