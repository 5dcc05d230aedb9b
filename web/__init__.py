"""The API's web server: how gunicorn serves app/ (`gunicorn app.wsgi:app`, the Procfile's
`web` process), beside the settings and lifecycle hooks in gunicorn.conf.py, which names the
worker class here.

web/worker.py   the gevent worker: gunicorn's, its own errors answered as JSON, its HTTP/1
                connections read and answered by the two modules below
web/request.py  a request's head and body read (gunicorn's parser, a plain head in one match)
web/answer.py   an answer written (gunicorn's Response, plain headers in one match, the Date
                once a second; the head sent with the body)
web/handover.py the hand-over across a graceful reload, between the hooks and the worker
web/canary.py   a models reload's check that gunicorn.conf.py and web/ on disk load (run by
                app/canary.py before the SIGHUP: a master that cannot read them exits)

Not under app/: gunicorn's master imports the worker class (reading gunicorn.conf.py) before
any worker process patches the standard library for gevent, and importing app/ builds Flask,
redis-py and their sockets and locks, which would then be made unpatched. So this package
imports gunicorn, gevent and the standard library only, and app/ does not import it
(.importlinter).
"""
