"""Handler registry: built-ins, the ``prorl_farm.handlers`` entry-point group, PRORL_HANDLERS."""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

from prorl_farm.errors import NotFound
from prorl_farm.handlers.base import AgentHandler

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "prorl_farm.handlers"
BUILTIN = {
    "synthetic": "prorl_farm.handlers.synthetic:SyntheticHandler",
    "chat": "prorl_farm.handlers.chat:ChatHandler",
    "math": "prorl_farm.handlers.math:MathHandler",
    "code": "prorl_farm.handlers.code:CodeHandler",
    "stem": "prorl_farm.handlers.stem:StemHandler",
    "shell": "prorl_farm.handlers.shell:ShellHandler",
    "swe": "prorl_farm.handlers.swe:SweHandler",
    "arith": "prorl_farm.handlers.arith:ArithHandler",
    "gym": "prorl_farm.handlers.gym:GymHandler",
}


def _load(target: str) -> type[AgentHandler]:
    module, _, attr = target.partition(":")
    obj = getattr(importlib.import_module(module), attr)
    if not (isinstance(obj, type) and issubclass(obj, AgentHandler)):
        raise TypeError(f"{target} is not an AgentHandler subclass")
    return obj


class HandlerRegistry:
    """Name -> handler instance. A plug-in that fails to load is logged and skipped."""

    def __init__(self, extra: str = "", use_entry_points: bool = True):
        self._targets: dict[str, str] = dict(BUILTIN)
        if use_entry_points:
            for ep in entry_points(group=ENTRY_POINT_GROUP):
                self._targets[ep.name] = ep.value
        # PRORL_HANDLERS="name=module:Class,other=module:Class" (no packaging needed).
        for item in filter(None, (x.strip() for x in extra.split(","))):
            name, _, target = item.partition("=")
            self._targets[name.strip()] = target.strip()
        self._handlers: dict[str, AgentHandler] = {}
        for name, target in self._targets.items():
            try:
                self._handlers[name] = _load(target)()
            except Exception:
                log.exception("handler %r (%s) failed to load; skipped", name, target)

    def get(self, name: str) -> AgentHandler:
        try:
            return self._handlers[name]
        except KeyError:
            raise NotFound(f"unknown handler {name!r}") from None

    def names(self) -> list[str]:
        return sorted(self._handlers)

    def __contains__(self, name: object) -> bool:
        return name in self._handlers
