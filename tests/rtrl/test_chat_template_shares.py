"""L5: a chat template slow only on some input must not let one client hold every
renderer. One client's chats render in at most its share of the renderer processes, so
another client's chat renders while the first client's slow ones run to their deadline."""

from __future__ import annotations

import contextvars
import threading

import pytest

from rtrl.chat_template import ChatRenderer, ChatTemplateSettings, TemplateOverBound, rendering_for

# Spins until the deadline on a message saying "spin" (finite, so a renderer without shares
# ends these renders too, only later); renders at once otherwise.
SPIN_ON_REQUEST = (
    "{% if messages[-1]['content'] == 'spin' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


def render_as(renderer: ChatRenderer, client: str, text: str) -> str:
    with rendering_for(client):
        return renderer.render(
            SPIN_ON_REQUEST,
            [{"role": "user", "content": text}],
            add_generation_prompt=False,
            variables={},
        )


def test_the_default_share_is_half_the_renderers_and_never_more_than_all():
    assert ChatTemplateSettings(renderers=2).client_share() == 1
    assert ChatTemplateSettings(renderers=8).client_share() == 4
    assert ChatTemplateSettings(renderers=1).client_share() == 1
    assert ChatTemplateSettings(renderers=2, client_renderers=5).client_share() == 2


@pytest.mark.guarantee(7)
def test_one_clients_slow_chats_leave_another_clients_chat_a_renderer():
    """Client "slow" sends as many spinning chats as there are renderers; client "other"
    then renders a plain chat. Without shares both renderers spin until their deadline and
    "other" waits for one; with them "other" is answered while every slow chat still runs."""
    renderer = ChatRenderer(ChatTemplateSettings(renderers=2, timeout_s=10))
    slow_done: list[BaseException | str] = []
    started = threading.Event()

    def slow() -> None:
        started.set()
        try:
            slow_done.append(render_as(renderer, "slow", "spin"))
        except TemplateOverBound as over:
            slow_done.append(over)

    try:
        threads = [
            threading.Thread(target=contextvars.copy_context().run, args=(slow,)) for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        started.wait()
        # Wait until the slow client holds what it may: a renderer busy with its chat.
        while renderer.in_flight < 1:
            threading.Event().wait(0.01)
        assert render_as(renderer, "other", "hello") == "hello"
        assert slow_done == [], "the other client waited for the slow client's deadline"
        for thread in threads:
            thread.join()
        assert len(slow_done) == 2 and all(isinstance(d, TemplateOverBound) for d in slow_done)
    finally:
        renderer.close()


def test_a_clients_chats_beyond_its_share_wait_their_turn_and_all_render():
    renderer = ChatRenderer(ChatTemplateSettings(renderers=2))
    answers: list[str] = []
    try:
        threads = [
            threading.Thread(target=lambda i=i: answers.append(render_as(renderer, "c", f"m{i}")))
            for i in range(6)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(answers) == [f"m{i}" for i in range(6)]
        assert renderer._held == {}  # every share given back
    finally:
        renderer.close()


def test_chats_of_no_client_are_held_to_no_share():
    """Outside a request, or on a serving API without keys, nobody can be told apart: every
    renderer serves them (here both render at once, each holding one)."""
    renderer = ChatRenderer(ChatTemplateSettings(renderers=2))
    held: list[int] = []
    both = threading.Barrier(2)

    def render() -> None:
        both.wait()
        render_as(renderer, "", "hi")
        held.append(len(renderer._idle))

    try:
        threads = [threading.Thread(target=render) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert renderer._held == {} and len(renderer._idle) == 2
    finally:
        renderer.close()
