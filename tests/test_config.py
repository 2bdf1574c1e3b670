"""Settings are declared once (prorl_farm/config.py): loading, validation, the documented
table and the deployment files all follow from the declaration, and nothing else reads a
PRORL_* variable."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prorl_farm import config
from prorl_farm.config import DEPLOY_ENV, env_names, load_settings, read
from prorl_farm.errors import ConfigError
from prorl_farm.harness import MODEL_ENV, PROMPT_FILE_ENV

ROOT = Path(__file__).resolve().parents[1]
# Set by the farm for the programs inside a sandbox: not settings of the farm.
INSIDE_ENV = {"PRORL_SANDBOX_ID", "PRORL_SANDBOX_IP", MODEL_ENV, PROMPT_FILE_ENV}
# The test suite's own (tests/farm.py: kept), not a setting of the farm.
SUITE_ENV = {"PRORL_TEST_CACHE"}


def test_the_documented_table_is_the_declaration():
    text = (ROOT / "docs" / "configuration.md").read_text()
    block = re.search(r"<!-- settings:begin[^>]*-->\n(.*?)<!-- settings:end -->", text, re.S)
    assert block, "docs/configuration.md has no generated settings table"
    assert block.group(1) == config.table(), "docs/configuration.md's table is stale: paste " \
        "`prorl-farm settings` between the settings markers"
    out = subprocess.run([sys.executable, "-m", "prorl_farm.cli", "settings"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out == config.table()


def test_every_setting_is_declared_with_its_bounds():
    for f, _stage in config._declared():
        meta = f.metadata
        assert meta["doc"], f.name
        if meta["cast"] in (int, float):
            assert meta["lo"] is not None and meta["hi"] is not None, f.name
    assert "PRORL_RUN_CONCURRENCY" in env_names() and "PRORL_URL" in env_names()


@pytest.mark.parametrize("env, message", [
    ({"PRORL_RUN_CONCURRENCY": "lots"}, "PRORL_RUN_CONCURRENCY='lots': not a valid int"),
    ({"PRORL_API_PORT": "0"}, "PRORL_API_PORT='0': must be a number from 1 to 65535"),
    ({"PRORL_HEARTBEAT_INTERVAL_S": "nan"}, "PRORL_HEARTBEAT_INTERVAL_S"),
    ({"PRORL_EVAL_POOL": "fibers"}, "PRORL_EVAL_POOL='fibers': expected one of"),
    ({"PRORL_NODE": "a.b"}, "PRORL_NODE='a.b': must match"),
    ({"PRORL_PRESENCE": "maybe"}, "PRORL_PRESENCE='maybe': not a valid bool"),
    ({"PRORL_LOG_LEVEL": "loud"}, "PRORL_LOG_LEVEL='loud'"),
    ({"PRORL_HEARTBEAT_STALE_S": "1"}, "at least 3 x"),
    ({"PRORL_FLOWER_BASIC_AUTH": "ops"}, "user:password"),
])
def test_a_bad_value_stops_loading_with_the_variable(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_settings(env)


def test_values_load_by_their_declared_type():
    s = load_settings({"PRORL_RUN_CONCURRENCY": "5", "PRORL_INIT_TIMEOUT_S": "30",
                       "PRORL_PRESENCE": "off", "PRORL_LOG_LEVEL": "DEBUG",
                       "PRORL_REDIS_URL": "redis://h:1/0", "PRORL_NODE": ""})
    assert (s.run.concurrency, s.init.timeout_s, s.eval.concurrency) == (5, 30.0, 8)
    assert s.presence is False and s.log_level == "DEBUG" and s.redis_url == "redis://h:1/0"
    assert s.node == config._short_hostname()  # empty: the default
    assert read("url", {"PRORL_URL": "http://farm:1"}) == "http://farm:1"
    assert read("url", {}) == "http://127.0.0.1:8000"


def _reads_of_prorl_env(path: Path) -> list[str]:
    """Reads of a literal PRORL_* variable: environ.get/getenv/pop, environ[...] (writes
    of a child's environment are not reads)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        target = None
        if isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("get", "getenv", "pop"):
                target = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            target = node.slice
        if (isinstance(target, ast.Constant) and isinstance(target.value, str)
                and target.value.startswith("PRORL_")):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target.value}")
    return found


def test_nothing_but_config_reads_a_setting():
    files = [p for d in ("prorl_farm", "api", "workers") for p in (ROOT / d).rglob("*.py")]
    reads = [r for p in files if p != ROOT / "prorl_farm" / "config.py"
             for r in _reads_of_prorl_env(p)]
    assert reads == []


def test_every_prorl_name_in_the_docs_and_deployment_is_declared():
    known = env_names() | set(DEPLOY_ENV) | INSIDE_ENV | SUITE_ENV
    sources = [ROOT / "README.md", ROOT / "docker-compose.yml", ROOT / "Dockerfile",
               ROOT / "Makefile", *(ROOT / "docs").glob("*.md"), *(ROOT / "slurm").iterdir()]
    for path in sources:
        used = set(re.findall(r"\bPRORL_[A-Z_]*[A-Z]\b", path.read_text()))
        used -= {n for n in used if re.fullmatch(r"PRORL_\{?[A-Z,]+\}?_.*", n) and "{" in n}
        assert used - known == set(), f"{path.name}: not declared: {sorted(used - known)}"


def test_the_compose_environment_loads():
    """The values compose gives each service (its defaults filled in) pass validation."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())

    def filled(value) -> str:
        return re.sub(r"\$\{(\w+)(?::-([^}]*)|:\?[^}]*)\}",
                      lambda m: "x:y" if m.group(2) is None else m.group(2), str(value))

    for _name, svc in compose["services"].items():
        env = {k: filled(v) for k, v in (svc.get("environment") or {}).items()
               if k.startswith("PRORL_")}
        if env:
            load_settings(env)  # raises ConfigError naming the variable
