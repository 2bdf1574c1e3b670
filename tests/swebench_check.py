"""SWE-bench's own code on the farm's data, run in a child interpreter (two swebench versions
cannot share one): ``python tests/swebench_check.py WHEEL UNIDIFF_WHEEL report|script``,
cases as JSON on stdin, answers as JSON on stdout.

- ``report`` (swebench 5.0.2): each case's ``log`` written to a file and read by
  ``get_eval_report``: ``{"resolved", "tests_status"}``;
- ``script`` (swebench 4.1.0): ``make_eval_script_list_py`` for each case's instance.

The wheels are imported as they are (zip import). The package ``__init__`` modules, which
import docker, datasets and modal for the harness's runner, are passed over: only the
grading, parsing and script-building modules run, and they need none of those (4.1.0's
``harness/utils.py`` imports ``datasets`` and ``dotenv`` at its top for loaders these
functions do not call: empty stand-ins take their place).
"""

import json
import sys
import tempfile
import types

# swebench's parser of each repository's log (``MAP_REPO_TO_PARSER``): pytest's but these.
PARSERS = {"django/django": "parse_log_django", "sympy/sympy": "parse_log_sympy"}


def names(value):
    """SWE-bench stores test lists as JSON strings; SWE-Gym and some copies as lists."""
    return json.loads(value) if isinstance(value, str) else value


def main():
    wheel, unidiff, what = sys.argv[1:4]
    sys.path[:0] = [wheel, unidiff]
    for name in ("swebench", "swebench.harness", "swebench.harness.test_spec"):
        module = types.ModuleType(name)
        module.__path__ = [f"{wheel}/{name.replace('.', '/')}"]
        sys.modules[name] = module
    cases = json.load(sys.stdin)
    out = []
    if what == "report":
        from swebench.harness.grading import get_eval_report
        from swebench.types import TestSpec

        for case in cases:
            inst = case["instance"]
            spec = TestSpec(instance_id=inst["instance_id"], image="", eval_script_list=[],
                            repo=inst["repo"], version=inst["version"],
                            FAIL_TO_PASS=names(inst["FAIL_TO_PASS"]),
                            PASS_TO_PASS=names(inst["PASS_TO_PASS"]),
                            log_parser=PARSERS.get(inst["repo"], "parse_log_pytest"),
                            eval_type="pass_and_fail")
            with tempfile.NamedTemporaryFile("w", suffix=".log") as f:
                f.write(case["log"])
                f.flush()
                report = get_eval_report(spec, {"instance_id": inst["instance_id"],
                                                "model_name_or_path": "farm",
                                                "model_patch": case.get("patch", "")},
                                         f.name, True)[inst["instance_id"]]
            out.append({"resolved": report["resolved"],
                        "applied": report["patch_successfully_applied"],
                        "tests_status": {k: report["tests_status"][k] for k in
                                         ("FAIL_TO_PASS", "PASS_TO_PASS")}
                        if "tests_status" in report else None})
    else:
        for name in ("datasets", "dotenv"):
            stand_in = types.ModuleType(name)
            stand_in.Dataset = stand_in.load_dataset = stand_in.load_from_disk = None
            stand_in.load_dotenv = lambda *a, **k: None
            sys.modules[name] = stand_in
        from swebench.harness.constants import MAP_REPO_VERSION_TO_SPECS
        from swebench.harness.test_spec.python import make_eval_script_list_py

        for case in cases:
            inst = case["instance"]
            specs = MAP_REPO_VERSION_TO_SPECS[inst["repo"]][inst["version"]]
            out.append(make_eval_script_list_py(inst, specs, "testbed", "/testbed",
                                                inst["base_commit"], inst["test_patch"]))
    json.dump(out, sys.stdout)


main()
