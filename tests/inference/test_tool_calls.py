"""inference/tool_calls.py: calls in the Hermes syntax (Qwen2.5, Qwen3) and the demo agent's
bang syntax parsed from a turn's text, none ever dropped, the same whatever pieces a stream
delivers the text in."""

from __future__ import annotations

import pytest

from rtrl.inference.tool_calls import (
    BangParser,
    Call,
    ParsedCall,
    StreamingParser,
    Text,
    family_of,
    parse,
    parser,
)

TOOLS = ("read_file", "search")
_NO_SEAR = "no tool 'sear' (offered: read_file, search)"


def _nameless(body: str) -> ParsedCall:
    return ParsedCall("", body, False, "the call names no tool")


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


READ_A = '{"name": "read_file", "arguments": {"path": "a.py"}}'
READ_B = '{"name": "read_file", "arguments": {"path": "b.py"}}'

# Each case: the turn's text, then its content and its calls.
CASES = {
    "text_alone": ("Just an answer.", "Just an answer.", ()),
    "one_call": (
        "Let me look.\n" + block(READ_A),
        "Let me look.\n",
        (ParsedCall("read_file", '{"path": "a.py"}', True),),
    ),
    "two_in_parallel": (
        block(READ_A) + "\n" + block(READ_B) + "\n",
        "\n\n",
        (
            ParsedCall("read_file", '{"path": "a.py"}', True),
            ParsedCall("read_file", '{"path": "b.py"}', True),
        ),
    ),
    "no_newlines_around_the_json": (
        f"<tool_call>{READ_A}</tool_call>",
        "",
        (ParsedCall("read_file", '{"path": "a.py"}', True),),
    ),
    "a_closing_tag_inside_an_argument": (
        block('{"name": "search", "arguments": {"q": "</tool_call> in docs"}}'),
        "",
        (ParsedCall("search", '{"q": "</tool_call> in docs"}', True),),
    ),
    "arguments_written_as_a_json_string": (
        block('{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}'),
        "",
        (ParsedCall("search", '{"q": "x"}', True),),
    ),
    "parameters_for_arguments": (
        block('{"name": "search", "parameters": {"q": "x"}}'),
        "",
        (ParsedCall("search", '{"q": "x"}', True),),
    ),
    "unknown_tool": (
        block('{"name": "rm_rf", "arguments": {}}'),
        "",
        (ParsedCall("rm_rf", "{}", False, "no tool 'rm_rf' (offered: read_file, search)"),),
    ),
    "malformed_json_then_a_good_call": (
        block('{"name": "search", "arguments": {q: x}}') + block(READ_B),
        "",
        (
            ParsedCall(
                "search",
                '\n{"name": "search", "arguments": {q: x}}\n',
                False,
                "the call is not JSON: Expecting property name enclosed in double quotes: "
                "line 1 column 34 (char 33)",
            ),
            ParsedCall("read_file", '{"path": "b.py"}', True),
        ),
    ),
    "arguments_not_an_object": (
        block('{"name": "search", "arguments": [1, 2]}'),
        "",
        (
            ParsedCall(
                "search",
                '\n{"name": "search", "arguments": [1, 2]}\n',
                False,
                "the arguments are not a JSON object",
            ),
        ),
    ),
    "text_after_the_object": (
        block(READ_A + " oops"),
        "",
        (
            ParsedCall(
                "read_file", "\n" + READ_A + " oops\n", False, "text after the call's JSON object"
            ),
        ),
    ),
    "cut_short_by_the_end_of_generation": (
        'Reading.\n<tool_call>\n{"name": "read_file", "argum',
        "Reading.\n",
        (
            ParsedCall(
                "read_file",
                '\n{"name": "read_file", "argum',
                False,
                "the generation ended inside the call (<tool_call> unclosed)",
            ),
        ),
    ),
    "cut_json_closed_by_its_tag": (
        block('{"name": "search", "arguments": {"q": "x"'),
        "",
        (
            ParsedCall(
                "search",
                '\n{"name": "search", "arguments": {"q": "x"\n',
                False,
                "the call is not JSON: Expecting ',' delimiter: line 1 column 42 (char 41)",
            ),
        ),
    ),
    "an_empty_block": (
        "<tool_call></tool_call>done",
        "done",
        (
            ParsedCall(
                "", "", False, "the call is not JSON: Expecting value: line 1 column 1 (char 0)"
            ),
        ),
    ),
    "a_tag_like_text_that_is_not_one": ("a <tool_ b <tool_cal", "a <tool_ b <tool_cal", ()),
}


@pytest.mark.parametrize("text, content, calls", CASES.values(), ids=CASES.keys())
def test_a_turn_parses_to_its_content_and_calls(text, content, calls):
    parsed = parse(text, TOOLS)
    assert (parsed.content, parsed.calls) == (content, calls)


def test_text_is_released_as_soon_as_it_cannot_begin_a_call():
    parser = StreamingParser(TOOLS)
    assert parser.feed("Hello <tool") == [Text("Hello ")]
    assert parser.feed("box> there") == [Text("<toolbox> there")]
    assert parser.feed("<tool_call>" + READ_A) == []  # the block waits for its closing tag
    assert parser.feed("</tool_call>") == [
        Call(0, ParsedCall("read_file", '{"path": "a.py"}', True))
    ]


def test_without_tools_offered_a_call_is_still_a_call_and_invalid():
    (call,) = parse(block(READ_A), None).calls
    assert (call.name, call.valid, call.error) == (
        "read_file",
        False,
        "the request offered no tools",
    )


def test_the_family_comes_from_the_chat_template():
    qwen3 = '{%- if tools %}...<tool_call>\\n{"name": ...}\\n</tool_call>{%- endif %}'
    assert family_of(qwen3) == "hermes"
    assert family_of("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}") is None
    assert family_of("{#- rtrl-tool-calls: bang -#}{{ bos_token }}...") == "bang"


BANG_CASES = {
    "text_alone": ("def f():\n  print('!')\n", "def f():\n  print('!')\n", ()),
    "one_call": ("!read_file\n", "", (ParsedCall("read_file", "{}", True),)),
    "parallel_calls_and_text": (
        'Reading both.\n!read_file {"path": "a.py"}\n!search\n',
        "Reading both.\n",
        (ParsedCall("read_file", '{"path": "a.py"}', True), ParsedCall("search", "{}", True)),
    ),
    "a_call_the_generation_ended_in": ("!sear", "", (ParsedCall("sear", "{}", False, _NO_SEAR),)),
    "a_misspelt_call_among_good_ones": (
        "!search\n!raed_file\n",
        "",
        (
            ParsedCall("search", "{}", True),
            ParsedCall(
                "raed_file", "{}", False, "no tool 'raed_file' (offered: read_file, search)"
            ),
        ),
    ),
    "arguments_that_are_no_object": (
        "!search [1]\n",
        "",
        (ParsedCall("search", "[1]", False, "the arguments are not a JSON object"),),
    ),
    "broken_arguments": (
        "!search {\n",
        "",
        (
            ParsedCall(
                "search",
                "{",
                False,
                "the arguments are not JSON: Expecting property name enclosed in double quotes: "
                "line 1 column 2 (char 1)",
            ),
        ),
    ),
    "a_bang_that_names_nothing": ("!\n! x\n", "", (_nameless(""), _nameless(" x"))),
    "a_bang_inside_a_line_is_text": ("a !search\n", "a !search\n", ()),
}


@pytest.mark.parametrize("text, content, calls", BANG_CASES.values(), ids=BANG_CASES.keys())
def test_a_bang_turn_parses_to_its_content_and_calls(text, content, calls):
    parsed = parse(text, TOOLS, "bang")
    assert (parsed.content, parsed.calls) == (content, calls)


@pytest.mark.parametrize("family, cases", [("hermes", CASES), ("bang", BANG_CASES)])
def test_either_family_streamed_split_anywhere_parses_as_the_whole(family, cases):
    for text, *_ in cases.values():
        whole = parse(text, TOOLS, family)
        for cut in range(len(text) + 1):
            for pieces in ([text[:cut], text[cut:]], list(text[:cut]) + [text[cut:]]):
                stream = parser(family, TOOLS)
                events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
                content = "".join(e.text for e in events if isinstance(e, Text))
                assert content == whole.content, (cut, pieces)
                assert tuple(e.call for e in events if isinstance(e, Call)) == whole.calls


def test_bang_text_is_released_as_soon_as_its_line_cannot_be_a_call():
    stream = BangParser(TOOLS)
    assert stream.feed("de") == [Text("de")]
    assert stream.feed("f f():\n!sea") == [Text("f f():\n")]
    assert stream.feed("rch") == []  # a call waits for its line's end
    assert stream.feed("\nok") == [Call(0, ParsedCall("search", "{}", True)), Text("ok")]
