"""Chat templates rendered under bounds: time, output and memory.

A chat template is code that comes with a model directory, and Jinja gives a render no
deadline: ``{% for i in range(100000) %}{% for j in range(100000) %}`` spins a core for
hours, and ``{{ 10 ** (10 ** 8) }}`` spins in C while the template compiles, where no check
between loop steps could ever run. So every render happens in a renderer process
(rtrl/chat_template_child.py) that is killed at the deadline, bounded in memory and in the
text it may return. The rendering is transformers' own (``apply_chat_template(...,
tokenize=False)``), character for character.

Shares: one client's chats render in at most ``client_renderers`` of the processes at once
(the rest of its chats wait their turn without holding one), so a client whose messages
make a template slow, up to its deadline each, delays only itself; the others render in the
processes it cannot take. The client is the serving API's API key, carried to the render by
a context variable (``rendering_for``) that the request's handler sets and ``to_thread``
copies into the worker thread. Chats of no client (rendered outside a request, or by a
serving API without keys, where nobody can be told apart) are not held to a share.

Cost: ``renderers`` small Python processes per process that renders (started on first use
and kept; each ends when its parent does), and a pipe round trip per chat. The caller's
thread waits for the answer: the serving API waits in a worker thread, never on its
event loop.

A template is probed when its model directory is opened (rtrl/checkpoint.py) with a few
representative chats (``probes``); one that breaks a bound there is refused, and the
bound is still enforced on every request, whose messages the probe never saw.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rtrl import chat_template_child
from rtrl.config import Settings, env_name

CHILD = Path(chat_template_child.__file__)
HEADER = struct.Struct(">I")
STARTUP_TIMEOUT_S = 60.0
"""A renderer process's start (Python and jinja2 imported): slow only on a loaded host."""


class ChatTemplateSettings(Settings):
    """Bounds on rendering a model's chat template (env prefix ``RTRL_CHAT_TEMPLATE_``),
    wherever a model directory is opened: `rtrl up --model`, the trainer, the serving API,
    the SGLang sidecar. Give every process the same values: a template `rtrl up` accepts
    must not be refused by a worker."""

    model_config = SettingsConfigDict(env_prefix="RTRL_CHAT_TEMPLATE_")

    timeout_s: float = Field(2.0, gt=0, le=60)
    """Longest one chat may take to render, compiling the template included. A template
    over it at load is refused; a request over it is answered 400."""

    max_chars: int = Field(1_000_000, ge=10_000, le=100_000_000)
    """Most characters one rendered chat may have."""

    max_memory_mb: int = Field(512, ge=128, le=65_536)
    """Address space of each renderer process, in MiB: what one expression may allocate."""

    renderers: int = Field(2, ge=1, le=64)
    """Renderer processes per process: how many chats render at once (more wait their turn)."""

    client_renderers: int | None = Field(None, ge=1, le=64)
    """Most renderer processes one client's chats hold at once; unset: half of ``renderers``
    (at least one). One client's slow chats then leave the other half to everyone else."""

    def client_share(self) -> int:
        """The renderers one client may hold at once (never more than there are)."""
        share = self.client_renderers or max(1, self.renderers // 2)
        return min(share, self.renderers)


_client: contextvars.ContextVar[str] = contextvars.ContextVar("rtrl_render_client", default="")


@contextlib.contextmanager
def rendering_for(client: str) -> Iterator[None]:
    """Within this block (and the threads ``asyncio.to_thread`` starts from it), chats render
    within ``client``'s share of the renderers."""
    token = _client.set(client)
    try:
        yield
    finally:
        _client.reset(token)


class TemplateFailed(ValueError):
    """The template raised (its ``raise_exception``, an undefined name, a type error): the
    message is the template's."""


class TemplateOverBound(TemplateFailed):
    """The template broke a bound: ``bound`` is the setting's name (``timeout_s``, ...)."""

    def __init__(self, bound: str, what: str) -> None:
        super().__init__(f"it {what} ({env_name(ChatTemplateSettings, bound)})")
        self.bound = bound


def _over(settings: ChatTemplateSettings, bound: str) -> TemplateOverBound:
    what = {
        "timeout_s": f"took longer than {settings.timeout_s:g} s to render",
        "max_chars": f"rendered more than {settings.max_chars} characters",
        "max_memory_mb": f"needed more than {settings.max_memory_mb} MiB to render",
    }[bound]
    return TemplateOverBound(bound, what)


class _Deadline(Exception):
    pass


class _Ended(Exception):
    """The renderer process ended while rendering."""


class _Renderer:
    """One renderer process, used by one thread at a time."""

    def __init__(self, max_memory_mb: int) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-I", str(CHILD), str(max_memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        try:
            ready = self.exchange(None, STARTUP_TIMEOUT_S)
        except (_Deadline, _Ended):
            self.kill()
            raise RuntimeError(f"the chat template renderer ({CHILD}) did not start") from None
        assert ready == {"ready": True}, ready

    def exchange(self, request: Mapping[str, Any] | None, timeout_s: float) -> dict[str, Any]:
        """Send ``request`` (none: read the greeting) and read the answer by ``timeout_s``."""
        stdin, stdout = self._pipes()
        if request is not None:
            body = json.dumps(request).encode()
            try:
                stdin.write(HEADER.pack(len(body)) + body)
            except BrokenPipeError:
                raise _Ended from None
        deadline = time.monotonic() + timeout_s
        (size,) = HEADER.unpack(self._read(stdout, HEADER.size, deadline))
        answer: dict[str, Any] = json.loads(self._read(stdout, size, deadline))
        return answer

    @staticmethod
    def _read(stream: IO[bytes], size: int, deadline: float) -> bytes:
        chunks: list[bytes] = []
        while size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([stream], [], [], left)[0]:
                raise _Deadline
            chunk = os.read(stream.fileno(), min(size, 1 << 20))
            if not chunk:
                raise _Ended
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def _pipes(self) -> tuple[IO[bytes], IO[bytes]]:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        return self.popen.stdin, self.popen.stdout

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()
        self.close()

    def close(self) -> None:
        """Closing its stdin ends an idle renderer; one still rendering ends by its alarm."""
        for pipe in self._pipes():
            pipe.close()


class ChatRenderer:
    """Renders chat templates in up to ``settings.renderers`` renderer processes, each
    render bounded by ``settings``. Thread-safe; ``shared_renderer`` gives one per process."""

    def __init__(self, settings: ChatTemplateSettings) -> None:
        self.settings = settings
        self._slots = threading.BoundedSemaphore(settings.renderers)
        self._lock = threading.Lock()
        self._share = settings.client_share()
        self._shares = threading.Condition()
        self._held: dict[str, int] = {}
        """Renders per client now (a client leaves the map when its last render ends)."""
        self._idle: list[_Renderer] = []
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Chats being rendered now."""
        return self._in_flight

    def render(
        self,
        template: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        variables: Mapping[str, Any],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The chat as ``apply_chat_template(..., tokenize=False)`` renders it; ``variables``
        are the tokenizer's special tokens (``special_tokens_map``). Raises TemplateFailed,
        or TemplateOverBound naming the bound the template broke."""
        request = {
            "template": template,
            "messages": [dict(m) for m in messages],
            "tools": None if tools is None else [dict(t) for t in tools],
            "add_generation_prompt": add_generation_prompt,
            "variables": dict(variables),
            "max_chars": self.settings.max_chars,
            "timeout_s": self.settings.timeout_s,
        }
        with self._client_share(_client.get()), self._slots, self._rendering() as renderer:
            answer = renderer.exchange(request, self.settings.timeout_s)
        if "over" in answer:
            raise _over(self.settings, answer["over"])
        if "error" in answer:
            raise TemplateFailed(answer["error"])
        return str(answer["text"])

    @contextlib.contextmanager
    def _client_share(self, client: str) -> Iterator[None]:
        """One of ``client``'s turns to render, taken before a renderer slot: a client at its
        share waits here, holding nothing another client needs. Every render ends by its
        deadline, so the wait is bounded by the client's own renders. No client, no share."""
        if not client:
            yield
            return
        with self._shares:
            self._shares.wait_for(lambda: self._held.get(client, 0) < self._share)
            self._held[client] = self._held.get(client, 0) + 1
        try:
            yield
        finally:
            with self._shares:
                self._held[client] -= 1
                if not self._held[client]:
                    del self._held[client]
                self._shares.notify_all()

    @contextlib.contextmanager
    def _rendering(self) -> Iterator[_Renderer]:
        """An idle renderer (a new one if none is), given back after a render that ended
        in time; killed at the deadline, and the bound it broke raised."""
        with self._lock:
            self._in_flight += 1
            idle = self._idle.pop() if self._idle else None
        try:
            renderer = idle or _Renderer(self.settings.max_memory_mb)
            try:
                yield renderer
            except _Deadline:
                renderer.kill()
                raise _over(self.settings, "timeout_s") from None
            except _Ended:
                renderer.kill()
                alarmed = renderer.popen.returncode == -signal.SIGALRM  # its own backstop
                raise _over(self.settings, "timeout_s" if alarmed else "max_memory_mb") from None
            except BaseException:  # mid-exchange: its next answer would not be to the next request
                renderer.kill()
                raise
            with self._lock:
                self._idle.append(renderer)
        finally:
            with self._lock:
                self._in_flight -= 1

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for renderer in idle:
            renderer.close()


_shared: dict[tuple[int, str], ChatRenderer] = {}
_shared_lock = threading.Lock()


def shared_renderer(settings: ChatTemplateSettings | None = None) -> ChatRenderer:
    """This process's renderer for ``settings`` (default: the environment's). A forked
    child gets its own: the parent's renderer processes answer the parent only."""
    settings = settings or ChatTemplateSettings()
    key = (os.getpid(), settings.model_dump_json())
    with _shared_lock:
        if key not in _shared:
            _shared[key] = ChatRenderer(settings)
        return _shared[key]


@atexit.register
def _close_shared() -> None:
    for renderer in _shared.values():
        renderer.close()


# ---- the load-time probe ----------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """A representative chat a template must render within bounds at load."""

    name: str
    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] | None = None


TOOL = {
    "type": "function",
    "function": {
        "name": "rename_variable",
        "description": "Rename a variable everywhere in a file.",
        "parameters": {
            "type": "object",
            "properties": {"old": {"type": "string"}, "new": {"type": "string"}},
            "required": ["old", "new"],
        },
    },
}

PROBES = (
    Probe(
        "a system and a user message",
        (
            {"role": "system", "content": "You edit code."},
            {"role": "user", "content": "Rename x to total."},
        ),
    ),
    Probe(
        "a user, an assistant and a user message",
        (
            {"role": "user", "content": "Rename x to total."},
            {"role": "assistant", "content": "total = a + b"},
            {"role": "user", "content": "Now add a docstring."},
        ),
    ),
)
TOOL_PROBE = Probe(
    "a user message with a tool", ({"role": "user", "content": "Rename x to total."},), (TOOL,)
)


def probes(template: str) -> tuple[Probe, ...]:
    """The chats a template is probed with: with a tool too when it reads ``tools``."""
    return PROBES + ((TOOL_PROBE,) if "tools" in template else ())
