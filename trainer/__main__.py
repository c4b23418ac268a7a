"""``python -m trainer``: settings are parsed before torch is imported, so a bad
configuration fails at once."""

from __future__ import annotations

import asyncio
import logging

from rtrl.config import StackSettings
from trainer.config import TrainerSettings


def main() -> None:
    settings = TrainerSettings()
    stack = StackSettings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from trainer.service import serve

    asyncio.run(serve(settings, stack))


if __name__ == "__main__":
    main()
