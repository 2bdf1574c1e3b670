"""Agent harnesses as the agent of a job: a program of its own (mini-SWE-agent, a script on
the ``openai`` SDK, a coding CLI) run unchanged in the job's sandbox, its model calls served
by the job's gateway.

An instance names one in its ``agent`` field (:class:`HarnessOptions`): a preset, or a
command run with ``bash -c`` in the workspace. RUN then

1. pins the job to a backend (the sticky session every turn of the built-in loop uses) and
   opens a :class:`~prorl_farm.gateway.server.JobGateway` on the sandbox's gateway socket
   under a new key of this job only;
2. runs the harness (the tool server's ``exec``: a clean environment, its own session)
   with ``OPENAI_BASE_URL``/``OPENAI_API_BASE``/``ANTHROPIC_BASE_URL`` at the sandbox's
   loopback relay, the key in ``OPENAI_API_KEY``/``ANTHROPIC_API_KEY``, the model's name in
   ``PRORL_MODEL``, and the prompt as its argument, a file (``PRORL_PROMPT_FILE``) or its
   stdin;
3. ends when the harness exits, when a limit ends the episode (the gateway refuses the
   call that passes it; RUN kills the harness and goes on: EVAL grades what it left), when
   its ``time_limit_s`` or the job's deadline passes (the job fails ``timeout``, keeping
   what was captured), or when the job is cancelled. The key dies with the gateway, and
   the harness's processes with its session.

The result is the last segment of the capture as the trajectory, earlier segments in
``segments``, the capture stats, the harness's exit status and output tails, and its
``answer``: what EVAL grades for an answer task, taken by the preset's rule (:data:`ANSWER_
RULES`) and saying which rule gave it. A harness that exits non-zero, or without a sampled
call, fails the job ``harness_error`` (never a zero reward); one that finishes with no
answer earns 0, with the reason.
"""

from prorl_farm.harness.answers import answer_file, answer_rules, connections, take_answer
from prorl_farm.harness.install import install, npm_cache, uv_binary
from prorl_farm.harness.presets import (
    ANSWER_RULES,
    MODEL_ENV,
    PRESETS,
    PROMPT_FILE,
    PROMPT_FILE_ENV,
    HarnessOptions,
    Preset,
    context_refusal,
    needed_context,
)
from prorl_farm.harness.run import command_line, harness_env, run_harness

__all__ = ["ANSWER_RULES", "MODEL_ENV", "PRESETS", "PROMPT_FILE", "PROMPT_FILE_ENV",
           "HarnessOptions", "Preset", "answer_file", "answer_rules", "command_line",
           "connections", "context_refusal", "harness_env", "install", "needed_context",
           "npm_cache", "run_harness", "take_answer", "uv_binary"]
