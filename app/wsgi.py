"""gunicorn entry point: `gunicorn 'app.wsgi:app'` (gunicorn.conf.py picks the gevent worker)."""
import sys

if "gunicorn.workers.ggevent" in sys.modules:
    from gevent import monkey

    # The gevent worker patches the standard library before it loads the app; loaded any
    # earlier (--preload), redis-py's and kombu's sockets would block every request at once.
    if not monkey.is_module_patched("socket"):
        raise RuntimeError("the gevent worker must load the app itself: run without --preload")

import time  # noqa: E402

from app import create_app  # noqa: E402

started = time.time()  # before the app reads its models file (app/reloading.py)
app = create_app()
if "gunicorn.workers.ggevent" in sys.modules:  # bodies read under gevent Timeouts
    import os

    from app.reloading import ModelsWatch
    from app.request_body import GuardedBodies

    settings = app.extensions["iq.submitter"].settings
    app.wsgi_app = GuardedBodies(app.wsgi_app, settings.body_timeout_s)
    # A models reload announced in Redis: this gunicorn reloads gracefully onto the new file.
    stores = app.extensions["iq.store"]
    ModelsWatch(stores.redis, settings, app.extensions["iq.revision"], master=os.getppid(),
                started=started, groups={name: store.redis
                                         for name, store in stores.stores.items() if name}
                ).start()
