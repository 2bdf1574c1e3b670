"""Run as a non-root user: start a bwrap sandbox, use its tools, stop it, check it is gone."""

import os
import sys

import redis

from prorl_farm.sandbox.abstract import SandboxSpec, processes_of
from prorl_farm.sandbox.connection import ToolConnection
from prorl_farm.sandbox.manager import SandboxManager

assert os.geteuid() != 0
r = redis.Redis.from_url(sys.argv[1], decode_responses=True)
manager = SandboxManager(r, f"nonroot-{os.getpid()}", "bwrap", root=sys.argv[2])
sb = manager.start(SandboxSpec(workspace_files={"a.txt": "hello\n"}))
c = ToolConnection(sb.socket)
out = c.bash("cat a.txt; touch /usr/x 2>&1; echo $PRORL_SANDBOX_IP")
assert out["output"].splitlines()[0] == "hello", out
assert "cannot touch" in out["output"], out
assert out["output"].splitlines()[-1] == sb.ip, out
assert c.ipython("6 * 7")["results"] == ["42"]
c.call("str_replace", path="a.txt", old_str="hello", new_str="bye")
assert c.bash("cat a.txt")["output"] == "bye\n"
c.close()
manager.stop(sb)
assert not processes_of(sb.id) and not os.path.exists(os.path.join(sys.argv[2], sb.id))
print("PROBE OK")
