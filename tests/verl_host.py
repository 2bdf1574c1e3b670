"""One VeRL interpreter for the suite's VeRL checks (tests/test_verl.py): run with VeRL's
environment (.venv-verl), it imports VeRL and torch once (about 30 s on 2 cores), then runs
each check script it is asked for as ``__main__``, one at a time.

Requests on stdin, one JSON line each: ``[script, arg, ...]``. Each answer is one line on
stdout: ``RESULT {"rc": status, "out": what the script printed}``; what it writes to stderr
goes to this process's stderr.

    .venv-verl/bin/python tests/verl_host.py
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import traceback

MARK = "RESULT "


def main() -> None:
    import torch  # noqa: F401 - the imports the checks share, paid once
    import verl.protocol  # noqa: F401
    import verl.trainer.ppo.ray_trainer  # noqa: F401

    out = sys.stdout
    print(MARK + json.dumps({"rc": 0, "out": "ready"}), file=out, flush=True)
    for line in sys.stdin:
        script, *args = json.loads(line)
        buf, rc = io.StringIO(), 0
        sys.argv = [script, *args]
        try:
            with contextlib.redirect_stdout(buf):
                runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            rc = 1
        print(MARK + json.dumps({"rc": rc, "out": buf.getvalue()}), file=out, flush=True)


if __name__ == "__main__":
    main()
