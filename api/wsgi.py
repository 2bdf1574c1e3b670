"""WSGI entry point for gunicorn: ``gunicorn api.wsgi:app``."""

from api import create_app

app = create_app()
