"""A multi-worker Flask app under gunicorn sharing one cache.

``python -m examples.webapp`` runs it (see examples/README.md); ``app.py`` is
the application, ``gunicorn.conf.py`` starts the shared cache's owner in
gunicorn's master.
"""
