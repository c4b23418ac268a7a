"""``python -m rtrl.inference``: one inference worker (the serving API over the embedded
engine, its weight followers and its heartbeat)."""


def main() -> None:
    # Configuration first: a bad setting fails before torch is imported.
    from rtrl import entrypoint
    from rtrl.config import StackSettings
    from rtrl.inference.config import InferenceSettings
    from rtrl.runtime import service_process

    settings, stack = entrypoint.parse_settings(
        "python -m rtrl.inference",
        __doc__,
        InferenceSettings,
        StackSettings,
        required=InferenceSettings.required_secrets,
    )
    entrypoint.configure_logging()
    service_process()

    import asyncio

    import torch

    torch.set_num_threads(1)
    from rtrl import otel
    from rtrl.inference.server import SERVICE, serve

    otel.configure(SERVICE, stack)
    asyncio.run(serve(stack, settings))


if __name__ == "__main__":
    main()
