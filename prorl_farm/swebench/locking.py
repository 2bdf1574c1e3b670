"""Locks for SWE-bench environments: each (repository, version) resolved once from the
package registry, as SWE-bench's spec says, and frozen, so that every later build installs
exactly those versions (a build without a lock is reported as unpinned).

The package ships the locks of its own instances (``prorl_farm/swebench/locks``, made by
``examples/swe-bench/build.py locks``); ``prorl-farm swebench lock ROWS.jsonl --out DIR``
makes them for a user's own instances, in a directory ``PRORL_SWE_LOCKS`` names.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from prorl_farm.errors import InvalidInstance


def lock_rows(rows: list[dict], out: str, roots: list[str], pythons: str = "",
              force: bool = False, log=print) -> list[str]:
    """Write ``NAME.txt`` and ``NAME.build.txt`` in ``out`` for each (repository, version)
    of ``rows`` (from its first row's ``environment_setup_commit``, in the repository found
    under ``roots``); returns the paths written. A lock that exists is kept (``force``:
    made again)."""
    from prorl_farm.swebench.envs import EnvBuilder
    from prorl_farm.swebench.instance import git_source, refusal

    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    written, done = [], set()
    with tempfile.TemporaryDirectory(prefix="prs-envs-") as envs, \
            tempfile.TemporaryDirectory(prefix="prs-repos-") as cache:
        builder = EnvBuilder(envs, pythons)
        from prorl_farm.swebench import repos
        from prorl_farm.swebench.envs import spec_for

        for row in rows:
            why = refusal(row)
            if why:
                raise InvalidInstance(f"{row.get('instance_id')}: {why}", why)
            spec = spec_for(row["repo"], str(row["version"]))
            if spec is None or spec.name in done:
                continue
            done.add(spec.name)
            lock = target / f"{spec.name}.txt"
            if lock.exists() and not force:
                log(f"{spec.name}: {lock} exists (--force makes it again)")
                continue
            git_dir, _ = git_source(row, [r for r in roots if r], cache)
            commit = row["environment_setup_commit"]
            env = builder.ensure(spec, repos.tree(git_dir, commit),
                                 repos.full_commit(git_dir, commit), log=log, resolve=True)
            lock.write_text(f"# {spec.name}: resolved from the registry for Python "
                            f"{env.manifest['python_version']} by prorl-farm swebench lock\n"
                            + env.manifest["resolved"])
            build = target / f"{spec.name}.build.txt"
            build.write_text(f"# {spec.name}: the repository's build backend, for Python "
                             f"{env.manifest['python_version']}\n"
                             + env.manifest.get("resolved_build", ""))
            log(f"{spec.name}: {len(env.manifest['resolved'].splitlines())} packages locked")
            written += [str(lock), str(build)]
    return written
