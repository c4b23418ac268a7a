"""``python -m rtrl.trainer``: trains the policy on settled rewards and publishes the versions
the eval gate accepts. Settings are parsed before torch is imported, so a bad
configuration fails at once.

Under ``torchrun --nproc_per_node N -m rtrl.trainer`` the same service trains a model
sharded over N processes (trainer/learner.py): rank 0 consumes, judges and publishes.
"""

from __future__ import annotations

import asyncio
import logging
import os

from rtrl import entrypoint
from rtrl.config import StackSettings
from rtrl.runtime import service_process
from rtrl.trainer.config import TrainerSettings


def main() -> None:
    settings, stack = entrypoint.parse_settings(
        "python -m rtrl.trainer",
        __doc__,
        TrainerSettings,
        StackSettings,
        required=TrainerSettings.required_secrets,
    )
    entrypoint.configure_logging()
    service_process(shutdown_budget_s=None)
    from rtrl.trainer.distributed import close_world, init_world
    from rtrl.trainer.service import serve

    world = init_world()
    asyncio.run(serve(settings, stack, world))
    if world is not None:
        close_world()
        # Gloo's threads may still hold the last collectives' tensors; releasing them
        # during interpreter shutdown can abort the process (trainer/distributed.py).
        logging.shutdown()
        os._exit(0)


if __name__ == "__main__":
    main()
