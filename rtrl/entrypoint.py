"""One shape for every service's entry point: parse the settings, then set up logging
(and telemetry, in the service), then run.

    def main() -> None:
        settings, stack = entrypoint.parse_settings(
            "python -m rtrl.ingest", __doc__, IngestSettings, StackSettings,
            required=IngestSettings.required_secrets,
        )
        entrypoint.configure_logging()
        service_process()
        otel.configure(SERVICE, stack)
        asyncio.run(serve(stack, settings))

Services are configured by environment variables only, so the command line takes just
``--help``: the service's summary and every variable it reads, with its default and
the docstring under its field. Settings are parsed before anything heavy is imported,
so ``--help`` and a bad setting answer at once; a bad setting exits with status 2,
naming the variable, without a traceback. So does a secret the service needs
(``required``: each service's settings say which) that is unset; one that is set but
malformed (not an Ed25519 key, say) is a bad setting like any other.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

from pydantic import SecretStr, ValidationError
from pydantic_settings import BaseSettings

from rtrl.config import RequiredSecret, env_name

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Every service's log line: time, level, logger, message."""

QUIET_LIBRARIES = ("faust", "mode", "aiokafka", "kafka", "urllib3", "botocore", "grpc")
"""Libraries whose INFO lines are their own business: warnings and errors only."""

USAGE_ERROR = 2


def usage(prog: str, summary: str | None, classes: Sequence[type[BaseSettings]]) -> str:
    """``prog``'s summary (its module docstring) and every environment variable it reads."""
    lines = [f"usage: {prog} [--help]", ""]
    if summary:
        lines += [summary.strip().split("\n\n")[0], ""]
    lines.append("Configured by environment variables only:")
    for cls in classes:
        lines += ["", f"{cls.__name__}:"]
        for name, field in cls.model_fields.items():
            value = None if field.is_required() else field.get_default(call_default_factory=True)
            if field.is_required():
                default = "required"
            elif isinstance(value, SecretStr):
                default = (
                    "secret, default empty"
                    if not value.get_secret_value()
                    else "secret, has a default"
                )
            else:
                default = f"default {value!r}"
            description = " ".join((field.description or "").split())
            lines.append(f"  {env_name(cls, name)} ({default})")
            if description:
                lines.append(f"      {description}")
    return "\n".join(lines)


def parse_settings(
    prog: str,
    summary: str | None,
    *classes: type[BaseSettings],
    argv: Sequence[str] | None = None,
    required: Callable[..., Iterable[RequiredSecret]] | None = None,
) -> tuple[Any, ...]:
    """Each settings class read from the environment, in order; ``--help`` prints the usage
    and exits 0, anything else on the command line, a bad setting or a secret that
    ``required(*parsed)`` names and is unset exits 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(args):
        print(usage(prog, summary, classes))
        sys.exit(0)
    if args:
        _usage_error(
            prog,
            f"unexpected arguments {' '.join(args)!r}: settings come from environment variables (see --help)",
        )
    parsed = []
    for cls in classes:
        try:
            parsed.append(cls())
        except ValidationError as error:
            _usage_error(prog, "invalid configuration:\n" + _explain(cls, error))
    needed = required(*parsed) if required is not None else ()
    missing = [secret for secret in needed if not secret.is_set()]
    if missing:
        _usage_error(
            prog,
            "invalid configuration:\n"
            + "\n".join(f"  {secret.variable}: missing: {secret.why}" for secret in missing),
        )
    return tuple(parsed)


def _explain(cls: type[BaseSettings], error: ValidationError) -> str:
    lines = []
    for problem in error.errors(include_url=False, include_input=False):
        field = str(problem["loc"][0]) if problem["loc"] else ""
        where = env_name(cls, field) if field in cls.model_fields else f"{cls.__name__}"
        lines.append(f"  {where}: {problem['msg']}")
    return "\n".join(lines)


def _usage_error(prog: str, message: str) -> NoReturn:
    # sys.exit with a string would exit 1; 2 is the convention for usage errors.
    print(f"{prog}: {message}", file=sys.stderr)
    sys.exit(USAGE_ERROR)


def configure_logging(level: int = logging.INFO) -> None:
    """The one log format, on stderr, for the whole process."""
    logging.basicConfig(level=level, format=LOG_FORMAT, force=True)
    for library in QUIET_LIBRARIES:
        logging.getLogger(library).setLevel(max(level, logging.WARNING))
