"""`iq-client`: the client from the shell. Jobs go out as JSON lines on stdout, errors as JSON
lines on stderr; the exit status is 0 when every job is as asked, 1 otherwise, 2 for a usage
error and 130 after Ctrl-C (which cancels the jobs still being waited for). While it waits on
a terminal, a progress bar is drawn on stderr (the jobs' event streams feed it)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import IO, Any, Iterable

from inference_queue_client.client import DEFAULT_URL, Client
from inference_queue_client.errors import APIError, ConfigurationError, IQError, WaitTimeout
from inference_queue_client.jobs import BASE64, Job
from inference_queue_client.progress import Bar

EPILOG = """\
examples:
  printf 'hello world\\nhow are you\\n' | iq-client submit minilm-embed --wait
  iq-client submit ts-affine inputs.jsonl --json --per-job 16 | iq-client wait
  iq-client get 8f692a53-...      iq-client cancel 8f692a53-...
  iq-client list --status failed | iq-client retry | iq-client wait

The API's address and key come from --url/--api-key, or IQ_API_URL (else the port IQ_PORT on
127.0.0.1, as make run serves it) and IQ_API_KEY; a misspelt one of those is refused."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="iq-client", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _connection_arguments(p)
    commands = p.add_subparsers(dest="command", required=True)
    submit = commands.add_parser("submit", help="submit jobs; print each job")
    _submit_arguments(submit)
    wait = commands.add_parser("wait", help="wait for jobs to finish; print each")
    get = commands.add_parser("get", help="print jobs as they stand")
    cancel = commands.add_parser("cancel", help="cancel queued jobs; print each")
    retry = commands.add_parser("retry", help="retry jobs that failed, were cancelled or "
                                              "expired; print each new job")
    delete = commands.add_parser("delete", help="delete finished jobs")
    events = commands.add_parser("events", help="print each job's moves as they happen, "
                                                "one {event, job} line each")
    for sub in (wait, get, cancel, retry, delete, events):
        _job_ids_argument(sub)
    listing = commands.add_parser("list", help="print your jobs, newest first, without "
                                               "their outputs")
    _list_arguments(listing)
    for sub in (submit, wait, get):
        _encoding_argument(sub)
    for sub in (submit, wait):
        _waiting_arguments(sub)
    return p


def _connection_arguments(p: argparse.ArgumentParser) -> None:
    """Where the API is, how to call it, how long to keep trying: every command's."""
    p.add_argument("--url", help="the API (default: IQ_API_URL, else http://127.0.0.1:"
                                 f"<IQ_PORT>, else {DEFAULT_URL})")
    p.add_argument("--api-key", help="sent as Authorization: Bearer (default: IQ_API_KEY)")
    p.add_argument("--request-timeout", type=float, default=10.0, metavar="S",
                   help="connect/read timeout of one request (default 10)")
    p.add_argument("--retry-for", type=float, default=60.0, metavar="S",
                   help="give up a call after failing this long: 429, 503, dropped "
                        "connections (default 60)")
    p.add_argument("-v", "--verbose", action="store_true", help="say what it is doing")


def _submit_arguments(submit: argparse.ArgumentParser) -> None:
    """What `submit` reads and how it makes jobs of it."""
    submit.add_argument("model")
    submit.add_argument("file", nargs="?", default="-",
                        help="one input per line (default: stdin); blank lines are skipped")
    submit.add_argument("--json", action="store_true",
                        help="each line is a JSON value (a list of numbers for tensor models) "
                             "rather than plain text")
    submit.add_argument("--per-job", type=int, default=0, metavar="N",
                        help="inputs per job (default: all in one job)")
    submit.add_argument("--options", type=json.loads, help="the job's options, as JSON")
    submit.add_argument("--priority", choices=["high", "normal", "low"])
    submit.add_argument("--timeout-s", type=float, help="deadline for the job to start")
    submit.add_argument("--idempotency-key", help="with a single job only")
    submit.add_argument("--trace-id", help="sent as X-Request-ID")
    submit.add_argument("--wait", action="store_true",
                        help="wait for the jobs and print them finished")


def _job_ids_argument(sub: argparse.ArgumentParser) -> None:
    """The jobs a command acts on: on its command line or on stdin."""
    sub.add_argument("ids", nargs="*", metavar="JOB",
                     help="job ids; none or '-': read from stdin, one a line, as ids "
                          "or as the JSON lines `submit` prints")


def _list_arguments(listing: argparse.ArgumentParser) -> None:
    """`list`'s filters and its cap."""
    listing.add_argument("--status", choices=["queued", "running", "succeeded", "failed",
                                              "cancelled", "expired"],
                         help="only these (failed: the dead-letter view)")
    listing.add_argument("--model", help="only this model's")
    listing.add_argument("--limit", type=int, default=100, metavar="N",
                         help="at most N jobs (default 100; 0: all)")


def _encoding_argument(sub: argparse.ArgumentParser) -> None:
    """How outputs travel (`submit`, `wait`, `get`)."""
    sub.add_argument("--encoding-format", choices=[BASE64],
                     help="outputs as base64 float32 (submit asks the API for it; wait "
                          "and get decode it); printed as numbers either way")


def _waiting_arguments(sub: argparse.ArgumentParser) -> None:
    """How a command that waits for jobs waits (`submit --wait`, `wait`)."""
    sub.add_argument("--timeout", type=float, metavar="S",
                     help="stop waiting after S seconds in all (exit status 1)")
    sub.add_argument("--no-cancel", action="store_true",
                     help="leave the jobs queued on Ctrl-C")
    sub.add_argument("--progress", action=argparse.BooleanOptionalAction,
                     help="draw a progress bar on stderr (default: when it is a "
                          "terminal)")


class Usage(Exception):
    """A command line that cannot be carried out: said on stderr, exit status 2."""


class Output:
    """One JSON line per job on stdout, one per error on stderr; remembers whether all went
    as asked. A progress bar, if one is drawn, is cleared before each line and drawn again
    after it."""

    def __init__(self) -> None:
        self.ok = True
        self.bar: Bar | None = None

    def line(self, value: Any, stream: IO[str] | None = None) -> None:
        if self.bar is not None:
            self.bar.clear()
        print(json.dumps(value), file=stream or sys.stdout, flush=True)
        if self.bar is not None and self.bar.finished < self.bar.jobs:
            self.bar.draw()

    def job(self, job: Job, fine: bool = True) -> None:
        self.ok &= fine
        self.line(job.as_dict())

    def error(self, exc: IQError, job_id: str | None = None) -> None:
        self.ok = False
        body = exc.body if isinstance(exc, APIError) else {
            "code": type(exc).__name__, "message": str(exc)}
        self.line({**({"id": job_id} if job_id else {}), "error": body}, sys.stderr)


def read_inputs(stream: IO[str], as_json: bool) -> list[Any]:
    inputs = []
    for number, line in enumerate(stream, 1):
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        if not as_json:
            inputs.append(line)
            continue
        try:
            inputs.append(json.loads(line))
        except ValueError as exc:
            raise Usage(f"inputs line {number} is not JSON ({exc}); without --json each "
                        "line is a text") from None
    if not inputs:
        raise Usage("no inputs: one a line, from FILE or stdin")
    return inputs


def read_ids(given: list[str], stdin: IO[str]) -> list[str]:
    if given and given != ["-"]:
        return given
    ids = []
    for line in stdin:
        line = line.strip()
        if line:
            try:
                ids.append(json.loads(line)["id"] if line.startswith("{") else line)
            except (ValueError, KeyError, TypeError):
                raise Usage(f"not a job id, nor a JSON line with an id: {line[:80]}") from None
    return ids


def chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    size = size if size > 0 else max(len(items), 1)
    return (items[i:i + size] for i in range(0, len(items), size))


def wait_all(client: Client, ids: list[str], args: argparse.Namespace, out: Output) -> None:
    """Wait for each job in turn within one overall timeout; Ctrl-C cancels the unfinished.
    With a progress bar, each job is followed through its event stream."""
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    pending = list(ids)
    if pending and (args.progress if args.progress is not None else sys.stderr.isatty()):
        out.bar = Bar(sys.stderr, len(pending))
    try:
        while pending:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                job = _wait_one(client, pending[0], remaining, args, out.bar)
                out.job(job, job.status == "succeeded")
            except WaitTimeout as exc:
                out.job(exc.job, False)
            except IQError as exc:
                out.error(exc, pending[0])
            pending.pop(0)
    except KeyboardInterrupt:
        if not args.no_cancel:
            client.retry_for = 0.0  # one attempt each: the user wants out
            for job_id in pending:
                try:
                    out.job(client.cancel(job_id), False)
                except IQError as exc:
                    out.error(exc, job_id)
        raise
    finally:
        if out.bar is not None:
            out.bar.clear()


def _wait_one(client: Client, job_id: str, timeout: float | None, args: argparse.Namespace,
              bar: Bar | None) -> Job:
    if bar is None:
        return client.wait(job_id, timeout=timeout, cancel_on_interrupt=False,
                           encoding_format=args.encoding_format)
    for _event, job in client.events(job_id, timeout=timeout,
                                     encoding_format=args.encoding_format):
        bar.update(job)
    return job


def list_jobs(args: argparse.Namespace, client: Client, out: Output) -> None:
    listed = client.jobs(status=args.status, model=args.model,
                         page_size=min(args.limit or 100, 100))
    for count, job in enumerate(listed, 1):
        out.job(job)
        if count == args.limit:
            return


def _get(args: argparse.Namespace, client: Client, out: Output, job_id: str) -> None:
    out.job(client.get(job_id, encoding_format=args.encoding_format))


def _cancel(args: argparse.Namespace, client: Client, out: Output, job_id: str) -> None:
    out.job(client.cancel(job_id))


def _retry(args: argparse.Namespace, client: Client, out: Output, job_id: str) -> None:
    out.job(client.retry(job_id))


def _delete(args: argparse.Namespace, client: Client, out: Output, job_id: str) -> None:
    client.delete(job_id)
    out.line({"id": job_id, "deleted": True})


def _events(args: argparse.Namespace, client: Client, out: Output, job_id: str) -> None:
    for name, job in client.events(job_id):
        out.line({"event": name, "job": job.as_dict()})


# Commands that act on each job named, one after the other: an error is said, and the next
# job goes on.
EACH_JOB = {"get": _get, "cancel": _cancel, "retry": _retry, "delete": _delete,
            "events": _events}


def submit_jobs(args: argparse.Namespace, client: Client, out: Output) -> None:
    try:
        with sys.stdin if args.file == "-" else open(args.file, encoding="utf-8") as stream:
            inputs = read_inputs(stream, args.json)
    except OSError as exc:
        raise Usage(f"cannot read the inputs: {exc}") from None
    groups = list(chunks(inputs, args.per_job))
    if args.idempotency_key and len(groups) > 1:
        raise Usage("--idempotency-key names one job; drop --per-job")
    # One job: the API holds the submit until it is done (Prefer: wait), unless a progress
    # bar follows it. Several: all are submitted first, so that they can share batches,
    # then waited for.
    bar = args.progress if args.progress is not None else sys.stderr.isatty()
    hold = (args.timeout or client.max_wait) \
        if args.wait and len(groups) == 1 and not bar else None
    submitted = []
    for group in groups:
        try:
            job = client.submit(args.model, group, options=args.options,
                                priority=args.priority, timeout_s=args.timeout_s,
                                encoding_format=args.encoding_format,
                                idempotency_key=args.idempotency_key,
                                trace_id=args.trace_id, wait=hold,
                                cancel_on_interrupt=not args.no_cancel)
        except IQError as exc:
            out.error(exc)
            continue
        if not args.wait or job.terminal:
            out.job(job, job.status == "succeeded" if args.wait else True)
        else:
            submitted.append(job.id)
    wait_all(client, submitted, args, out)


def run(args: argparse.Namespace, client: Client, out: Output) -> None:
    if args.command == "submit":
        submit_jobs(args, client, out)
    elif args.command == "list":
        list_jobs(args, client, out)
    elif args.command == "wait":
        wait_all(client, read_ids(args.ids, sys.stdin), args, out)
    else:
        for job_id in read_ids(args.ids, sys.stdin):
            try:
                EACH_JOB[args.command](args, client, out, job_id)
            except IQError as exc:
                out.error(exc, job_id)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="iq-client: %(message)s", stream=sys.stderr)
    out = Output()
    try:
        client = Client(args.url, api_key=args.api_key, timeout=args.request_timeout,
                        retry_for=args.retry_for)
    except ConfigurationError as exc:
        print(f"iq-client: {exc}", file=sys.stderr)
        return 2
    with client:
        try:
            run(args, client, out)
        except Usage as exc:
            print(f"iq-client: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
    return 0 if out.ok else 1
