"""The API's gunicorn worker (gunicorn.conf.py names it: `worker_class`): gunicorn's gevent
worker, its HTTP/1 connections read by web/request.py's `Parser` and answered by
web/answer.py's `Reply` through `OneSend`, gunicorn's own errors answered as JSON, each setting
read once a process (`settle`), and, told to stop by a graceful reload, accepting until its
replacements are up (web/handover.py)."""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import time
from datetime import datetime

from gunicorn import util
from gunicorn.config import Config
from gunicorn.http import errors as http_errors, wsgi
from gunicorn.http.errors import ConfigurationProblem, InvalidHeader
from gunicorn.http2 import negotiation
from gunicorn.workers.ggevent import GeventWorker, gevent

from web.answer import OneSend, Reply
from web.handover import LOST_STOP, replaced, stopping
from web.request import Parser


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
        sig, lost = stopping(), os.environ.pop(LOST_STOP, None)
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
        """A connection, its requests parsed by `Request` (web/request.py). gunicorn's own
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
