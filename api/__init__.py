"""The farm's HTTP API (v1): Flask app factory."""

from __future__ import annotations

import time
from dataclasses import dataclass

from celery import Celery
from flask import Flask, g, request

from prorl_farm.access import AllowList, parse_allow_list
from prorl_farm.celery_app import create_celery_app
from prorl_farm.config import Settings, load_settings
from prorl_farm.errors import ConfigError
from prorl_farm.handlers.registry import HandlerRegistry
from prorl_farm.jobs.messages import StageMessages
from prorl_farm.jobs.payloads import TrajectoryStore, open_store
from prorl_farm.jobs.store import JobStore
from prorl_farm.llm.registry import BackendRegistry
from prorl_farm.metrics import LatencyRecorder
from prorl_farm.tenants import Tenant, parse_tenants


@dataclass
class FarmServices:
    """What the routes need, stored in ``app.extensions["prorl"]``."""

    settings: Settings
    store: JobStore
    registry: HandlerRegistry
    celery: Celery
    backends: BackendRegistry
    allow_list: AllowList
    latency: LatencyRecorder
    messages: StageMessages
    payloads: TrajectoryStore
    tenants: dict[str, Tenant]

    def close(self) -> None:
        """Close the connections the app holds (Redis, the broker's pool): for an app made
        and dropped in one process (tests, tools), so that no socket waits for the garbage
        collector."""
        self.celery.close()
        self.store.r.close()


def _time_requests(app: Flask, recorder: LatencyRecorder) -> None:
    @app.before_request
    def _start():
        g.prorl_t0 = time.perf_counter()

    @app.after_request
    def _observe(resp):
        t0 = g.get("prorl_t0")
        if t0 is not None:
            rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
            recorder.observe(f"api:{request.method}:{rule}", time.perf_counter() - t0)
        return resp


def create_app(settings: Settings | None = None) -> Flask:
    """Build the API. ``settings`` defaults to the PRORL_* environment (tests pass their own)."""
    from api import (
        access,
        backends,
        batches,
        dashboard,
        errors,
        handlers,
        health,
        jobs,
        openapi,
        tenants,
    )

    settings = settings or load_settings()
    if not settings.redis_url:
        raise ConfigError("PRORL_REDIS_URL must be set for the API")
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False
    store = JobStore.from_settings(settings, settings.api_threads + 8)
    celery = create_celery_app(settings)
    app.extensions["prorl"] = FarmServices(
        settings=settings,
        store=store,
        registry=HandlerRegistry(settings.handlers),
        celery=celery,
        backends=BackendRegistry(store.r),
        allow_list=parse_allow_list(settings.backend_allow),
        latency=LatencyRecorder(store.r),
        messages=StageMessages(celery),
        payloads=open_store(settings),
        tenants=parse_tenants(settings.tenants),
    )
    _time_requests(app, app.extensions["prorl"].latency)
    access.install(app, settings, app.extensions["prorl"].tenants, store,
                   app.extensions["prorl"].backends)
    for module in (jobs, batches, handlers, health, openapi, backends, dashboard, tenants):
        app.register_blueprint(module.bp)
    errors.register_error_replies(app)
    return app
