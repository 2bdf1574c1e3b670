"""NeMo Gym's side of tests/test_gym.py, run in Gym's own environment (.venv-gym, Python
3.13, nemo-gym 0.7.0); nothing of the farm is imported here.

    python tests/gym_side.py head +config_paths=[CFG]       Gym's head server serving the
                                                            config (Gym's own HeadServer)
    python tests/gym_side.py validate OUT.jsonl             every row through Gym's
                                                            BaseVerifyResponse; one JSON
                                                            line per row: reward, item classes
                                                            (or the error)
    python tests/gym_side.py nemo_rl HOST PORT ROWS.jsonl   the rows through Gym's
                                                            RolloutCollectionHelper.run_examples
                                                            as NeMo RL's NemoGym.run_rollouts
                                                            calls it, each result laid out as
                                                            NeMo RL's postprocess does
    python tests/gym_side.py counter PORT                   Gym's example_session_state_mgmt
                                                            resources server (a counter per
                                                            session), built as Gym's own
                                                            tests build its servers, served
                                                            by uvicorn with its access log
    python tests/gym_side.py serve ENV PORT                 the resources server of any
                                                            environment Gym ships
                                                            (resources_servers/ENV), built
                                                            the same way from its own
                                                            config file, with no model
                                                            server behind it (a judge it
                                                            calls fails its /verify)
"""

from __future__ import annotations

import asyncio
import json
import sys


def head() -> None:
    from nemo_gym.global_config import get_global_config_dict
    from nemo_gym.server_utils import HeadServer

    get_global_config_dict()  # from the command line, as Gym's CLIs read it
    _, thread, server = HeadServer.run_webserver()
    server.mark_ready()
    print("ready", flush=True)
    thread.join()


def counter(port: str) -> None:
    from unittest.mock import MagicMock

    import uvicorn
    from nemo_gym.server_utils import ServerClient
    from resources_servers.example_session_state_mgmt.app import (
        StatefulCounterResourcesServer,
        StatefulCounterResourcesServerConfig,
    )

    config = StatefulCounterResourcesServerConfig(host="127.0.0.1", port=int(port),
                                                  entrypoint="", name="counter")
    server = StatefulCounterResourcesServer(config=config,
                                            server_client=MagicMock(spec=ServerClient))
    uvicorn.run(server.setup_webserver(), host="127.0.0.1", port=int(port), log_level="info")


def server_of(env: str, port: int):
    """The resources server ENV ships, built from its config file (configs/ENV.yaml, else
    its first) as Gym's own tests build one: the config class validated from the file's
    ``resources_servers`` block, a ServerClient that reaches nothing."""
    import importlib
    from pathlib import Path
    from unittest.mock import MagicMock

    import yaml
    from nemo_gym.base_resources_server import SimpleResourcesServer
    from nemo_gym.server_utils import ServerClient

    module = importlib.import_module(f"resources_servers.{env}.app")
    here = Path(module.__file__).parent
    classes = [c for c in vars(module).values() if isinstance(c, type)
               and issubclass(c, SimpleResourcesServer) and c.__module__ == module.__name__]
    cls = next(c for c in classes if not any(o is not c and issubclass(o, c) for o in classes))
    configs = sorted((here / "configs").glob("*.yaml"))
    config_file = here / "configs" / f"{env}.yaml"
    doc = yaml.safe_load((config_file if config_file.exists() else configs[0]).read_text())
    block = next(v["resources_servers"] for v in doc.values()
                 if isinstance(v, dict) and "resources_servers" in v)
    name, fields = next(iter(block.items()))
    config_cls = cls.model_fields["config"].annotation
    config = config_cls.model_validate({**fields, "host": "127.0.0.1", "port": port,
                                        "name": name})
    return cls(config=config, server_client=MagicMock(spec=ServerClient))


def serve(env: str, port: str) -> None:
    import importlib.util
    import os

    import uvicorn

    # Relative data paths in configs are the server's own.
    os.chdir(importlib.util.find_spec(f"resources_servers.{env}").submodule_search_locations[0])
    server = server_of(env, int(port))
    uvicorn.run(server.setup_webserver(), host="127.0.0.1", port=int(port), log_level="info")


def validate(path: str) -> None:
    from nemo_gym.base_resources_server import BaseVerifyResponse

    for line in open(path):
        try:
            row = BaseVerifyResponse.model_validate(json.loads(line))
        except ValueError as e:
            print(json.dumps({"error": str(e)[:2000]}))
            continue
        print(json.dumps({"reward": row.reward,
                          "items": [type(o).__name__ for o in row.response.output]}))


def postprocess(row: dict, result: dict) -> dict:
    """What NeMo RL makes of one ``/run`` result (NVIDIA-NeMo/RL at 7ea279ab), re-implemented
    without torch, step by step as its code does:

    - ``NemoGym._postprocess_nemo_gym_to_nemo_rl_result`` (nemo_rl/environments/
      nemo_gym.py): for each output item with non-empty ``generation_token_ids`` (its
      ``_is_trainable_output_item``), assert the item's ``prompt_token_ids`` begin with every
      token seen so far ("Non-contiguous messages found!"), then a ``user`` message of the
      new prompt tokens and an ``assistant`` message of the generated tokens with their
      ``generation_logprobs``; no such item raises ValueError ("NeMo Gym returned a result
      with no generation data"), which its rollout manager counts as a data failure of the
      prompt (nemo_rl/experience/failures.py: retried ``max_data_attempts_per_prompt``
      times, then skipped while ``max_skipped_prompts`` allows, else the step fails);
    - flattened as ``batched_message_log_to_flat_message`` does (nemo_rl/data/
      llm_message_utils.py): ``token_ids`` concatenated, generation logprobs 0 on
      non-assistant tokens, the loss mask 1 on assistant tokens (GRPO's
      ``add_grpo_token_loss_masks_and_generation_logprobs``);
    - ``reward``: ``float(result["reward"])`` (rollout_manager.py ``_result_to_completion``);
      ``mask_sample``: ``result["instance_config"]["mask_sample"]`` (rollouts.py
      ``_extract_mask_sample_flags``), whose rows get ``loss_multiplier`` 0 (grpo.py
      ``_apply_mask_sample_filter``)."""
    assert isinstance(result, dict), f"Hit a non-successful response: {result}"
    seen: list[int] = []
    message_log = []
    for item in result["response"]["output"]:
        if not item.get("generation_token_ids"):
            continue
        prompt = item["prompt_token_ids"]
        assert seen == prompt[:len(seen)], "Non-contiguous messages found!"
        new = prompt[len(seen):]
        message_log.append({"role": "user", "token_ids": new})
        message_log.append({"role": "assistant", "token_ids": item["generation_token_ids"],
                            "generation_logprobs": item["generation_log_probs"]})
        seen += new + item["generation_token_ids"]
    if not message_log:
        raise ValueError("NeMo Gym returned a result with no generation data.")
    flat = {"token_ids": [], "generation_logprobs": [], "token_loss_mask": []}
    for m in message_log:
        n = len(m["token_ids"])
        flat["token_ids"] += m["token_ids"]
        flat["generation_logprobs"] += m.get("generation_logprobs") or [0.0] * n
        flat["token_loss_mask"] += [1 if m["role"] == "assistant" else 0] * n
    mask = bool((result.get("instance_config") or {}).get("mask_sample", False))
    return {"rowidx": row["_rowidx"], "job_id": result["prorl_job_id"],
            "reward": float(result["reward"]), "mask_sample": mask,
            "loss_multiplier": 0.0 if mask else 1.0, **flat}


def nemo_rl(host: str, port: str, rows_path: str) -> None:
    from nemo_gym.rollout_collection import RolloutCollectionHelper
    from nemo_gym.server_utils import BaseServerConfig

    rows = [json.loads(line) for line in open(rows_path)]

    async def run() -> None:
        helper = RolloutCollectionHelper()
        for task in helper.run_examples(
                examples=rows, head_server_config=BaseServerConfig(host=host, port=int(port))):
            row, result = await task
            try:
                laid = postprocess(row, result)
            except Exception as e:  # noqa: BLE001 - what NeMo RL's rollout manager catches
                laid = {"rowidx": row["_rowidx"], "job_id": result.get("prorl_job_id"),
                        "error": f"{type(e).__name__}: {e}"}
            print(json.dumps(laid), flush=True)

    asyncio.run(run())


if __name__ == "__main__":
    what, *args = sys.argv[1:]
    if what == "head":
        sys.argv = [sys.argv[0], *args]
        head()
    else:
        {"validate": validate, "nemo_rl": nemo_rl, "counter": counter,
         "serve": serve}[what](*args)
