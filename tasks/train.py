"""Flyte task `rollout_and_train` over `envace_core.stages.train`: rollouts and role-wise GRPO steps
for K iterations.

One worker (the default, and every local run) is a plain task on one GPU. ENVACE_TRAIN_NNODES /
ENVACE_TRAIN_GPUS above 1 at registration make it a flytekitplugins-kfpytorch `Elastic` task with
one worker per GPU (see tasks/resources.py): torch elastic starts the workers with WORLD_SIZE, RANK,
MASTER_ADDR/PORT set, they join one process group (`envace_core.training.distributed`) and train data
parallel (rollouts split by task, LoRA gradients all-reduced every optimizer step); rank 0 writes
the checkpoints and its result is the task's output.

Both variables are also the task's container environment (`train_environment`): the pod imports
this module again to load the task, and must build the same (Elastic) task it was registered as.
"""

import json

import envace_core  # noqa: F401
import envace_core.stages.train as train
from envace_core.config import config_from_json
from envace_core.training.distributed import session
from tasks.resources import stage_task, train_environment, train_scale, train_task_config

_ELASTIC = train_task_config(*train_scale())


# Elastic workers share tensors through /dev/shm, which a pod's default 64 MiB cannot hold.
@stage_task("rollout_and_train", task_config=_ELASTIC, shared_memory=_ELASTIC is not None,
            environment=train_environment())
def rollout_and_train(config: str, dataset: str, warm: str) -> str:
    """K iterations of rollouts + role-wise GRPO from the warm start `warm` (the warm_start task's
    JSON); checkpoints to the artifact store (JSON result).

    Cached on (config, dataset, warm, code): a finished run with the same inputs is not trained
    again. A run that failed is not cached, and re-running it resumes from its last checkpoint.
    """
    with session():  # one worker: no process group; Elastic workers: one, torn down after
        return json.dumps(train.rollout_and_train(config_from_json(config), json.loads(dataset),
                                                  json.loads(warm)), default=str)
