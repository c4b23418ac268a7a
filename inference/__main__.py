"""``python -m inference``: one inference worker."""

import logging


def main() -> None:
    # Configuration first: a bad setting fails before torch is imported.
    from inference.config import InferenceSettings
    from rtrl.config import StackSettings
    from rtrl.runtime import service_process

    settings = InferenceSettings()
    stack = StackSettings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    service_process()

    import asyncio

    import torch

    torch.set_num_threads(1)
    from inference.server import SERVICE, serve
    from rtrl import otel

    otel.configure(SERVICE, stack)
    asyncio.run(serve(stack, settings))


if __name__ == "__main__":
    main()
