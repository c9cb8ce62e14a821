# gunicorn configuration of the example app: the shared cache's owner is
# started in gunicorn's master before the workers fork, and stopped when the
# master exits (docs/deployment.md, "gunicorn: start the owner in the master").
#
# The workers attach to it by name in app.py; both read the same environment
# variables. `python -m examples.webapp` sets them and passes --bind and
# --workers.
import os

from client_query_cache import SharedCache

MONGODB_URI = os.environ["MONGODB_URI"]
CACHE_NAME = os.environ.get("EXAMPLE_CACHE", "webapp-example")

# Sync workers handle one request at a time, so a worker's hit counter tells
# exactly whether the request it is answering was a hit (app.py).
worker_class = "sync"
# The app module is imported in each worker after the fork (gunicorn's
# default): its CacheManager must be created in the worker.
preload_app = False
# gunicorn's control socket (for gunicornc) defaults to one path per user,
# which a second gunicorn on the host would contend for; the example does not
# use it.
control_socket_disable = True

owner = None


def on_starting(server):
    global owner
    owner = SharedCache.start(CACHE_NAME, MONGODB_URI, arena_bytes=40 << 20,
                              budget_bytes=32 << 20, slots=16384)
    server.log.info("shared cache %r: owner pid %d", CACHE_NAME, owner.pid)


def on_exit(server):
    if owner is not None:
        owner.stop()
