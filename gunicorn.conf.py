"""gunicorn's settings for the API, read by every `gunicorn app.wsgi:app` started in this
folder (scripts/web.sh, the tests, a plain command line); flags given on the command line win.

The API waits a lot: `?wait` and `Prefer: wait` hold a request until its job finishes. With
gunicorn's gevent worker each request is a greenlet, not a thread, so thousands can wait
while /healthz, /readyz, /metrics and submits are answered. The worker monkey-patches the
standard library (gevent.monkey.patch_all) in each worker process before it imports the app,
so redis-py and kombu, which the app imports, cooperate: a request blocked on Redis yields to
the others. Do not add --preload: it would import the app, and open its sockets, before that.
"""
import errno
import functools
import json
import os
import re
import resource
import shutil
import signal
import socket
import tempfile
import time
from datetime import datetime

from gunicorn import util
from gunicorn.config import Config
from gunicorn.http import errors as http_errors, message, wsgi
from gunicorn.http.errors import ConfigurationProblem, InvalidHeader
from gunicorn.http.body import LengthReader
from gunicorn.http.parser import RequestParser
from gunicorn.http2 import negotiation
from gunicorn.workers.ggevent import GeventWorker, gevent

from config import load_settings

_settings = load_settings()


def _json_error(sock, status_int, reason, mesg):
    """gunicorn's own error answers (a malformed request line or header, headers too large,
    a proxy header it refuses) in the API's JSON envelope rather than an HTML page."""
    code = {400: "malformed_request", 500: "internal"}.get(
        status_int, reason.lower().replace(" ", "_"))
    body = json.dumps({"error": {"code": code, "message": mesg or reason}}).encode()
    head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    util.write_nonblock(sock, head.encode("latin-1") + body)


class Worker(GeventWorker):
    """gunicorn's gevent worker, answering its own errors as JSON. A SCRIPT_NAME header from a
    trusted proxy that does not prefix the path is the request's fault: 400, not 500. Told to
    stop by a graceful reload, it goes on accepting until its replacements are up (`replaced`),
    or the master is told to stop (`stopping`).
    """

    _leaving = False

    def init_process(self):
        util.write_error = _json_error  # what Worker.handle_error writes its answer with
        settle(self.cfg)
        super().init_process()

    def init_signals(self):
        """A stop the master sent before this process set its handlers (it was importing
        gevent, and held the master's): lost, it would serve until the master's SIGKILL."""
        super().init_signals()
        sig, lost = stopping(), os.environ.pop(_LOST_STOP, None)
        if sig is not None:
            self.log.info("Stop (%s) before this process was ready: stopping",
                          signal.Signals(sig).name)
        elif lost:  # told to stop by a reload (`_stop_noted`)
            sig = int(lost)
            self.log.info("Told to stop (%s) by a reload as it booted", signal.Signals(sig).name)
        if sig is not None:
            (self.handle_exit if sig == signal.SIGTERM else self.handle_quit)(sig, None)

    def handle_exit(self, sig, frame):
        """SIGTERM (gunicorn's master sends it again each second until the process exits)."""
        if self._leaving:
            return
        self._leaving = True
        if replaced(self.age, self.cfg.workers):
            self.alive = False
            return
        import gevent

        gevent.spawn(self._stop_once_replaced)

    def _stop_once_replaced(self):
        import gevent

        until = time.monotonic() + self.cfg.timeout
        while time.monotonic() < until and not replaced(self.age, self.cfg.workers):
            gevent.sleep(0.1)
        if stopping() in (signal.SIGINT, signal.SIGQUIT):  # the master's quick stop
            super().handle_quit(signal.SIGQUIT, None)
        self.alive = False  # the run loop stops accepting, and finishes what it holds

    def handle(self, listener, client, addr):
        """A connection, its requests parsed by `Request` (below). gunicorn's own
        `AsyncWorker.handle` (gevent's `handle` before it) makes its parser with gunicorn's
        Request class, which no setting changes: this is its HTTP/1 path, line for line, with
        `Parser`. A connection gunicorn would treat otherwise (TLS, HTTP/2 with prior
        knowledge, the uwsgi protocol, no keep-alive) goes to gunicorn's as before.
        tests/unit/test_web_parser.py holds gunicorn's method to the one copied here."""
        cfg = self.cfg
        if cfg.is_ssl or not cfg.keepalive or getattr(cfg, "protocol", "http") != "http" or \
                negotiation.prior_knowledge_allowed(cfg, addr):
            return super().handle(listener, client, addr)
        client.setblocking(1)  # GeventWorker.handle's: blocking mode, under gevent
        req = None
        try:
            parser = Parser(cfg, client, addr)
            try:
                listener_name = listener.getsockname()
                proxy_protocol_info = {}
                while True:
                    req = None
                    with self.timeout_ctx():
                        req = next(parser)
                    if not req:
                        break
                    if self._try_h2c_upgrade(listener, req, parser, client, addr):
                        return None
                    if req.proxy_protocol_info:
                        proxy_protocol_info = req.proxy_protocol_info
                    else:
                        req.proxy_protocol_info = proxy_protocol_info
                    self.handle_request(listener_name, req, client, addr)
            except http_errors.NoMoreData as e:
                self.log.debug("Ignored premature client disconnection. %s", e)
            except StopIteration as e:
                self.log.debug("Closing connection. %s", e)
            except OSError:
                raise  # to the next level, as gunicorn's
            except Exception as e:
                self.handle_error(req, client, addr, e)
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                self.log.exception("Socket error processing request.")
            elif e.errno == errno.ECONNRESET:
                self.log.debug("Ignoring connection reset")
            elif e.errno == errno.ENOTCONN:
                self.log.debug("Ignoring socket not connected")
            else:
                self.log.debug("Ignoring EPIPE")
        except BaseException as e:
            self.handle_error(req, client, addr, e)
        finally:
            util.close(client)
        return None

    def handle_request(self, listener_name, req, sock, addr):
        """Each answer's head leaves with its body (OneSend), the answer written by `Reply`."""
        out = OneSend(sock, req)
        try:
            self._answer(listener_name, req, out, addr)
        except (gevent.GreenletExit, SystemExit):
            pass  # GeventWorker.handle_request's
        finally:
            out.flush()

    def _answer(self, listener_name, req, sock, addr):
        """gunicorn's `AsyncWorker.handle_request`, line for line, its answer made by `Reply`
        (gunicorn's `wsgi.create` takes the class: its HTTP/2 path gives its own).
        tests/unit/test_web_parser.py holds gunicorn's method to the one copied here."""
        request_start = datetime.now()
        environ = {}
        resp = None
        try:
            self.cfg.pre_request(self, req)
            resp, environ = wsgi.create(req, sock, addr, listener_name, self.cfg,
                                        response_class=Reply)
            environ["wsgi.multithread"] = True
            self.nr += 1
            if self.nr >= self.max_requests:
                if self.alive:
                    self.log.info("Autorestarting worker after current request.")
                    self.alive = False
            if not self.alive or not self.cfg.keepalive:
                resp.force_close()
            respiter = self.wsgi(environ, resp.start_response)
            if self.is_already_handled(respiter):
                return False
            try:
                if isinstance(respiter, environ['wsgi.file_wrapper']):
                    resp.write_file(respiter)
                else:
                    for item in respiter:
                        resp.write(item)
                resp.close()
            finally:
                request_time = datetime.now() - request_start
                self.log.access(resp, req, environ, request_time)
                if hasattr(respiter, "close"):
                    respiter.close()
            if resp.should_close():
                raise StopIteration()
        except StopIteration:
            raise
        except OSError:
            raise  # the caller's to handle (handle() may ignore it), as gunicorn's
        except (Exception, SystemExit):
            if resp and resp.headers_sent:
                self.log.exception("Error handling request")
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    sock.close()
                except OSError:
                    pass
                raise StopIteration()
            raise
        finally:
            try:
                self.cfg.post_request(self, req, environ, resp)
            except Exception:
                self.log.exception("Exception in post_request hook")
        return True

    def handle_error(self, req, client, addr, exc):
        if isinstance(exc, ConfigurationProblem) and "SCRIPT_NAME" in str(exc):
            exc = InvalidHeader("SCRIPT_NAME", req=req)
        super().handle_error(req, client, addr, exc)


class OneSend:
    """A client's socket while gunicorn answers one request on it (Worker.handle_request).
    gunicorn sends an answer's head (status line and headers) with one `sendall` and its
    body with the next: two system calls, two segments on the wire, and a client woken for
    a head without its body, a request. The head is held and leaves with the body's first
    bytes (up to `JOINED` of them; a larger body follows the head on its own), in one call;
    an answer without a body sends its head when the request is done (`flush`), and any
    other use of the socket (gunicorn's sendfile, a close) sends it first. An interim answer
    (`100 Continue`, which a client may wait for before it sends its body) is never held, and
    the answer's head after it still is. Nor is a streamed (chunked) answer's head: gunicorn
    sends nothing for an empty write of one, so a stream whose first write is empty would
    have its head held until its next, which may be long in coming. The app sees this object as
    `environ["gunicorn.socket"]`: `client` is the socket under it, and `close_after_answer`
    asks for the connection to be closed after this answer."""

    JOINED = 65536
    __slots__ = ("client", "_head", "_fresh", "_req")

    def __init__(self, client, req=None) -> None:
        self.client, self._head, self._fresh, self._req = client, None, True, req

    def close_after_answer(self) -> None:
        """gunicorn closes the connection once this answer is sent, and the answer's head says
        `Connection: close`: what the app asks when the rest of the request's body will never
        be read (app/request_body.py: a body past its deadline), so that the connection is
        not kept for a next request that would start inside that body."""
        if self._req is not None:
            self._req.must_close = True

    def sendall(self, data, *flags):
        head = self._head
        if head is not None:
            self._head = None
            if not flags and len(data) <= self.JOINED:
                return self._whole(head + data)
            self._whole(head)
        elif self._fresh and not flags and data[:5] == b"HTTP/":
            if data[8:10] == b" 1":  # an interim answer: its client may be waiting for it
                return self._whole(data)
            self._fresh = False
            if b"\r\nTransfer-Encoding: chunked\r\n" not in data:
                self._head = bytes(data)
                return None
        self._fresh = False
        if flags:
            return self.client.sendall(data, *flags)
        return self._whole(data)

    def _whole(self, data) -> None:
        """`sendall(data)`, tried first as one `send`: an answer is far smaller than the
        socket's buffer, and gevent's `sendall` asks the kernel for that buffer's size
        (a getsockopt) and runs its send loop for each call. What one send leaves goes
        by `sendall`, as before."""
        sent = self.client.send(data)
        if sent < len(data):
            self.client.sendall(memoryview(data)[sent:])

    def flush(self) -> None:
        head, self._head, self._fresh = self._head, None, False
        if head is not None:
            self._whole(head)

    def __getattr__(self, name):
        # The held head first. Nothing held yet (gunicorn's 100 Continue goes by `send`
        # before the answer), the answer's head that follows is still held.
        if self._head is not None:
            self.flush()
        return getattr(self.client, name)


# RFC 9110's token (a header's name, message.TOKEN_RE) and the characters a value may hold
# (all but those message.RFC9110_5_5_INVALID_AND_DANGEROUS refuses; HTAB among them), as
# gunicorn's parser checks them; a head is its lines, `name:value`, joined by CRLF.
_NAME = r"[!#$%&'*+\-.^_`|~0-9a-zA-Z]+"
_VALUE = r"[^\x00-\x08\x0a-\x1f\x7f]*"
_PLAIN_HEAD = re.compile(rf"{_NAME}:{_VALUE}(?:\r\n{_NAME}:{_VALUE})*")
_FIELD = re.compile(rf"({_NAME}):({_VALUE})")
# Fields the header policy (message.HeaderPolicy) does more with than keep: a second Host or
# Content-Type is refused, an Expect answered.
_WATCHED = frozenset(("HOST", "CONTENT-TYPE", "EXPECT"))


class Request(message.Request):
    """gunicorn's HTTP/1 request, its head read in fewer steps where it is plain, to the same
    result. gunicorn's `parse_headers` takes each line in turn: decoded, split, its name
    matched, upper-cased, its value stripped and searched, and the header policy applied, ~13
    calls a field. A head of plain fields (each `name:value` of RFC 9110's characters, no
    folded line, none longer than `limit_request_field_size`, no more of them than
    `limit_request_fields`, none that the policy does more than keep: Host or Content-Type
    once, no Expect, no scheme header, no name with "_") is decoded once and matched whole;
    any other, and a trailer, goes through gunicorn's, which answers or refuses it as before.
    Whether a peer may send forwarding headers (`forwarded_allow_ips`, fixed for the
    process's life) is worked out once a peer address, not at each request."""

    _trusted: dict[tuple[Config, str], bool] = {}  # (the settings, a peer's address)
    KNOWN_PEERS = 4096

    def parse_headers(self, data, from_trailer=False):
        cfg = self.cfg
        if from_trailer or cfg.strip_header_spaces:
            return super().parse_headers(data, from_trailer)
        text = data.decode("latin-1")
        fields = _FIELD.findall(text) if _PLAIN_HEAD.fullmatch(text) else None
        if fields is None or len(fields) > self.limit_request_fields or \
                len(text) + 2 > self.limit_request_field_size:
            return super().parse_headers(data, from_trailer)
        secure, _forwarders = self._peer_trusted_for_forwarded()
        headers, watched = [], ()
        for name, value in fields:
            name = name.upper()
            if name in _WATCHED:
                if name == "EXPECT" or name in watched:
                    return super().parse_headers(data, from_trailer)
                watched += (name,)
            if "_" in name or name in secure:
                return super().parse_headers(data, from_trailer)
            headers.append((name, value.strip(" \t")))
        return headers

    def _peer_is_trusted_proxy(self):
        peer = self.peer_addr
        if not isinstance(peer, tuple):
            return True
        known = (self.cfg, peer[0])
        trusted = self._trusted.get(known)
        if trusted is None:
            trusted = super()._peer_is_trusted_proxy()
            if len(self._trusted) < self.KNOWN_PEERS:
                self._trusted[known] = trusted
        return trusted


# An answer's header as gunicorn's Response takes it unchanged (wsgi.process_headers): a name
# of RFC 9110's token, a value of its field-vchar, SP and HTAB (wsgi.HEADER_VALUE_RE) that
# starts and ends with neither of the last two; held as `name\0value`, joined by "\n".
_ANSWER_VALUE = r"(?:[\x21-\x7e\x80-\xff](?:[ \t\x21-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?"
_ANSWER_HEAD = re.compile(rf"{_NAME}\0{_ANSWER_VALUE}(?:\n{_NAME}\0{_ANSWER_VALUE})*")
_ANSWER_NAME = re.compile(rf"^({_NAME})\0", re.MULTILINE)


class Reply(wsgi.Response):
    """gunicorn's HTTP/1 answer, its headers taken in fewer steps where they are plain, to the
    same result, and its Date header made once a second. gunicorn's `process_headers` checks
    each header in turn (two types, two matches, a strip, two lower-cases, a hop-by-hop
    look-up: ~10 calls a header). A list of plain headers (str names and values gunicorn
    accepts as they are, none hop-by-hop, at most one Content-Length) is checked joined, in
    one match; any other goes through gunicorn's, which refuses or sorts it as before."""

    _date = (0, "")  # (the second, its HTTP date)

    def process_headers(self, headers):
        if type(headers) is not list:
            return super().process_headers(headers)
        pairs = [(n, v) for n, v in headers if type(n) is str and type(v) is str]
        if len(pairs) != len(headers):
            return super().process_headers(headers)
        joined = "\n".join([f"{n}\0{v}" for n, v in pairs])
        if pairs and not _ANSWER_HEAD.fullmatch(joined):
            return super().process_headers(headers)
        names = _ANSWER_NAME.findall(joined.lower())
        if not util.hop_headers.isdisjoint(names):
            return super().process_headers(headers)
        if "content-length" in names:
            if names.count("content-length") > 1:
                return super().process_headers(headers)
            try:
                self.response_length = int(pairs[names.index("content-length")][1])
            except ValueError:
                return super().process_headers(headers)  # which raises it
        self.headers.extend(pairs)
        return None

    def default_headers(self):
        """gunicorn's, with the date made once a second (`util.http_date`, to the second)."""
        if self.upgrade:
            connection = "upgrade"
        elif self.should_close():
            connection = "close"
        else:
            connection = "keep-alive"
        now = int(time.time())
        second, date = Reply._date
        if second != now:
            second, date = Reply._date = (now, util.http_date(now))
        headers = [
            "HTTP/%s.%s %s\r\n" % (self.req.version[0], self.req.version[1], self.status),
            "Server: %s\r\n" % self.version,
            "Date: %s\r\n" % date,
            "Connection: %s\r\n" % connection
        ]
        if self.chunked:
            headers.append("Transfer-Encoding: chunked\r\n")
        return headers


class Parser(RequestParser):
    """gunicorn's HTTP/1 parser, its requests made by `Request`. Before it reads the next
    request, gunicorn discards what the app left of the last one's body (`finish_body`):
    it saves the socket's timeout, reads the body once more, 1 KiB asked through its
    Body, its reader and the unreader (~25 calls), and sets the timeout back. A body of
    known length the app read to its end (every API request's: a GET's is of length 0)
    has nothing left to discard: that is known from the Body, and the same answer given
    at once."""

    mesg_class = Request

    def finish_body(self, deadline=None, max_bytes=None):
        body = getattr(self.mesg, "body", None)
        if body is not None and type(body.reader) is LengthReader and \
                body.reader.length == 0 and body.failed is False and not body.buf.tell():
            return True
        return super().finish_body(deadline, max_bytes)


def settle(cfg: Config) -> None:
    """Each setting's value kept on `cfg` itself, read once in this process rather than
    through `Config.__getattr__` and the setting's `get` at every use: gunicorn reads ~23 a
    request (its parser, `wsgi.create`, the keep-alive timeout, its hooks). A forked process's
    settings never change: a reload re-reads them in the master, which forks new processes.
    The values go into the instance's dict, under `Config.__setattr__`'s guard; the settings
    `Config` answers with a property (`is_ssl`, `worker_class`, ...) are left to it."""
    for name, setting in cfg.settings.items():
        if not hasattr(Config, name):
            vars(cfg)[name] = setting.get()


def default_workers() -> int:
    """A quarter of the cores this process may run on, at least one. One gevent process uses
    one core and carries ~500-1,000 one-input jobs/s (bench/README.md, "On a GPU": it was the
    limit of a 16-core GPU host); the other cores go to the pool children (a core each), the
    worker's main process and Redis. 2 cores: 1 process, 16: 4."""
    return max(1, len(os.sched_getaffinity(0)) // 4)


worker_class = Worker
workers = int(os.environ.get("IQ_WEB_WORKERS") or default_workers())
# /metrics sums the counters of every process (prometheus_client's multiprocess mode), one
# process included: gunicorn may run more than `workers` says here (`-w` or GUNICORN_CMD_ARGS
# win over this file, SIGTTIN adds one while it runs), and a process that counted alone would
# answer a scrape with its own counts, each scrape another process's. Unless the operator names
# a folder, each start gets a fresh one, so that no count from an earlier run is added in; it
# is removed when gunicorn exits. Set here, in gunicorn's master before it forks, so that each
# worker imports prometheus_client with it already set.
_OWN_METRICS = "iq-api-metrics-"


def _own_metrics_folder(folder: str) -> bool:
    """Whether `folder` is the one this master made (its pid in the name). A SIGHUP re-reads
    this file in the same master, which keeps its folder; a master exec'd by a USR2 (gunicorn's
    binary upgrade) after a SIGHUP inherits the variable from its parent and makes its own,
    so that neither removes the other's when it exits."""
    return os.path.basename(folder).startswith(f"{_OWN_METRICS}{os.getpid()}-")


_folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
if not _folder or (os.path.basename(_folder).startswith(_OWN_METRICS)
                   and not _own_metrics_folder(_folder)):
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(
        prefix=f"{_OWN_METRICS}{os.getpid()}-")

# prometheus_client's multiprocess counters share one lock a process, made with the `Lock` its
# values module took from `threading` when it was imported. Imported in the worker, after the
# gevent worker patched `threading`, that is gevent's lock, Python code (~10 calls a counter
# write; four writes a request). Imported here, in the master before it forks, it is the
# interpreter's. No greenlet switches while holding it: a write puts a few bytes into an mmap.
import prometheus_client.values  # noqa: E402,F401  (app/metrics.py makes the metrics)


# The hand-over across a graceful reload (SIGHUP: a models reload's, app/reloading.py, or an
# operator's). gunicorn's master starts the new processes and at once tells the old ones to stop
# (SIGTERM), on which they stop accepting within a second; the new ones accept only once they
# have imported and built the app, seconds on a loaded host: nothing accepted meanwhile, and every
# request sent then waited in the listen queue (3.3 s with two API processes on a loaded two-core
# machine, 5.9 s once). Instead the master notes, on a reload, the age gunicorn gives the first
# new process (`on_reload`); each process says it is up once its app is built
# (`post_worker_init`), its entry gone when it exits (`child_exit`); an old process told to stop
# goes on accepting until as many new ones are up as gunicorn runs, or the master's `timeout`
# passed (the master kills a new process not up by then), then stops as before (Worker). A stop
# of the whole gunicorn, no reload since the process started, is not delayed. The entries are
# files in a folder of the master's own, which its processes inherit: `reload` holds the age,
# `up-<age>-<pid>` one per process up. A stop of the master (SIGTERM, SIGINT, SIGQUIT) ends the
# wait: gunicorn's master handles it only once the old processes are gone (it waits for them in
# its reload), so its handler (`when_ready`) first writes `stop`, the signal's number; an old
# process sees it and stops as that signal says (SIGTERM: it finishes what it holds), and a new
# one that lost the master's signal before it set its own handlers stops too (Worker).
_HANDOVER, _OWN_HANDOVER = "_IQ_API_HANDOVER_DIR", "iq-api-handover-"
_LOST_STOP = "_IQ_API_LOST_STOP"  # a reload's SIGTERM to a process before it set its handlers
_handover = os.environ.get(_HANDOVER, "")
if not os.path.basename(_handover).startswith(f"{_OWN_HANDOVER}{os.getpid()}-"):
    os.environ[_HANDOVER] = tempfile.mkdtemp(prefix=f"{_OWN_HANDOVER}{os.getpid()}-")


def _up_entry(worker) -> str:
    return os.path.join(os.environ[_HANDOVER], f"up-{worker.age}-{worker.pid}")


def on_reload(server):
    folder = os.environ[_HANDOVER]
    staged = os.path.join(folder, ".reload")
    with open(staged, "w") as out:
        out.write(str(server.worker_age + 1))  # spawn_worker's next age
    os.replace(staged, os.path.join(folder, "reload"))


def post_worker_init(worker):
    """The app built: its start-up objects are frozen out of the garbage collector's full
    collections (tasks/heap.py), which otherwise walk them all every few thousand requests;
    then the process says it is up."""
    from tasks.heap import freeze_start_up

    freeze_start_up()
    open(_up_entry(worker), "w").close()


def when_ready(server):
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, functools.partial(_stop_noted, server.pid, server.signal))


def _stop_noted(master, handler, sig, frame):
    """The master's handler of a stop: `stop` written, then gunicorn's own (which queues it).
    A process gunicorn forks holds it until it sets its own: what it gets meanwhile is a
    reload's SIGTERM (a second reload, or one while a killed process's replacement boots), for
    it alone, kept for it (Worker.init_signals). Noted as the master's stop, it had every
    process started since exit as it booted, nothing serving until gunicorn was restarted."""
    if os.getpid() != master:
        os.environ[_LOST_STOP] = str(int(sig))
        return
    folder = os.environ[_HANDOVER]
    staged = os.path.join(folder, ".stop")
    try:
        with open(staged, "w") as out:
            out.write(str(int(sig)))
        os.replace(staged, os.path.join(folder, "stop"))
    except OSError:
        pass  # the folder gone (the master exiting): nothing waits on it
    handler(sig, frame)


def stopping() -> int | None:
    """The stop the master was told (a signal's number), or None."""
    try:
        with open(os.path.join(os.environ.get(_HANDOVER, ""), "stop")) as found:
            return int(found.read())
    except (OSError, ValueError):
        return None


def _reload_age() -> int | None:
    """The age of the last reload's first process; None: no reload since the master started."""
    try:
        with open(os.path.join(os.environ.get(_HANDOVER, ""), "reload")) as found:
            return int(found.read())
    except (OSError, ValueError):
        return None


def replaced(age: int, processes: int) -> bool:
    """Whether the process of `age`, told to stop, may stop accepting now: no reload since it
    started (a stop), the master told to stop, or `processes` processes of the last reload
    are up."""
    folder, first = os.environ.get(_HANDOVER, ""), _reload_age()
    if stopping() is not None or first is None or first <= age:
        return True
    ups = [name.split("-") for name in os.listdir(folder) if name.startswith("up-")]
    return sum(1 for _up, entry_age, _pid in ups if int(entry_age) >= first) >= processes


def child_exit(server, worker):
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess
        multiprocess.mark_process_dead(worker.pid)
    try:
        os.unlink(_up_entry(worker))
    except FileNotFoundError:
        pass  # it exited before its app was built
    _replace_in_hand_over(server, worker)


def _replace_in_hand_over(server, worker):
    """A process of the last reload gone (a SIGKILL, a crash, the master's `timeout`) while
    older ones hand over: gunicorn's master (reaping, in its reload, while it waits for the old
    ones to exit) starts another only once fewer processes run than it should, which the older
    ones, accepting until as many new ones are up, never let happen. They held on for
    `timeout`, then left together, and with one process nothing accepted while its replacement
    booted. Its replacement is started now; not once gunicorn is told to stop."""
    first = _reload_age()
    if first is None or worker.age < first or not server.LISTENERS or \
            stopping() is not None:
        return
    ages = [other.age for other in server.WORKERS.values()]
    if any(age < first for age in ages) and \
            sum(1 for age in ages if age >= first) < server.num_workers:
        server.log.info("API process %s of the reload gone before its elders left: "
                        "its replacement started", worker.pid)
        server.spawn_worker()


def on_exit(server):
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
    if _own_metrics_folder(folder):  # made above by this master, not the operator's
        shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(os.environ[_HANDOVER], ignore_errors=True)


# Connections one worker holds at once: every allowed wait (max_waits) plus room for probes,
# submits and reads beside them. Past it, gunicorn stops accepting until one closes.
worker_connections = _settings.max_waits + 1000
timeout = 60
# A graceful reload (SIGHUP, app/reloading.py) or stop lets the old processes finish what they
# hold, the longest `?wait` included, before they go.
graceful_timeout = int(_settings.max_wait_s) + 5
preload_app = False
control_socket_disable = True
# Proxy headers (SCRIPT_NAME, X-Forwarded-Proto, ...) are honoured from these addresses only;
# none by default. From any other peer a header with an underscore (SCRIPT_NAME) is dropped.
forwarded_allow_ips = _settings.forwarded_allow_ips
header_map = "drop"

# Each connection is a file descriptor; a default soft limit of 1024 would refuse connections
# long before worker_connections. Raise it as far as the hard limit allows.
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
_wanted = worker_connections + 256
if _soft != resource.RLIM_INFINITY and _soft < _wanted:
    _limit = _wanted if _hard == resource.RLIM_INFINITY else min(_wanted, _hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_limit, _hard))


def post_fork(server, worker):
    """Each API process knows its gunicorn (its address) and how many processes it runs, for
    a models reload to count them (app/reloading.py)."""
    os.environ["_IQ_API_BIND"] = ",".join(server.cfg.bind)
    os.environ["_IQ_API_PROCESSES"] = str(server.num_workers)
