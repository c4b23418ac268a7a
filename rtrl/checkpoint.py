"""A policy is named by a Hugging Face model directory: config.json, safetensors, a
tokenizer and (for chat) a chat template. The trainer, the inference workers and the
sidecar all open it here, so there is one loading path; the built-in demo policy is
written as such a directory too (``write_demo_checkpoint``).

What a service needs of it:

* ``spec`` (rtrl.policy.ModelSpec): the architecture, e.g. for the engine's fast path;
* ``tensors``: every tensor's name, shape and dtype as stored, read from the safetensors
  headers without loading the weights, to check a version against before serving it;
* ``encode``, ``render_chat``, ``decode``: text to token ids and back. A prompt is
  tokenized once, at the door; from there on only token ids travel (the rollout record
  holds exactly the ids the model saw and sampled, and nothing re-tokenizes them);
* ``load_model(dtype, device)``: the trainer's AutoModelForCausalLM.

The directory is the user's input. Nothing it names as code is run (rtrl/custom_code.py:
a model that needs its own code is refused, and every loader passes
``trust_remote_code=False``), and its chat template renders under bounds
(rtrl/chat_template.py): ``open`` probes it, and refuses a template that breaks one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, processors
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from rtrl import chat_tokens, policy
from rtrl.chat_template import (
    ChatRenderer,
    ChatTemplateSettings,
    TemplateFailed,
    TemplateOverBound,
    probes,
    shared_renderer,
)
from rtrl.chat_tokens import ControlTextRefused, RenderedChat
from rtrl.custom_code import CustomCodeRefused, refuse_custom_code
from rtrl.policy import ModelSpec

DTYPES: Mapping[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The trainer's compute dtypes (a setting)."""


class CheckpointError(ValueError):
    """The directory is not a usable checkpoint; the message says what is missing or wrong."""


class ChatTemplateError(ValueError):
    """The checkpoint has no chat template, or its template failed on these messages."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str
    """As safetensors names it: F32, BF16, F16..."""


class Checkpoint:
    """One Hugging Face model directory, opened (config and tokenizer read; weights only
    on ``load_model`` / ``load_weights``)."""

    def __init__(
        self,
        path: Path,
        config: PretrainedConfig,
        tokenizer: PreTrainedTokenizerFast,
        renderer: ChatRenderer | None = None,
    ) -> None:
        """Use ``Checkpoint.open(path)`` (or ``builtin_demo()``)."""
        self.path = path
        self.config = config
        self.spec = ModelSpec.from_hf_config(config)
        self.tokenizer = tokenizer
        self.renderer = renderer or shared_renderer()
        """Renders the chat template, bounded (the environment's RTRL_CHAT_TEMPLATE_*)."""
        if len(tokenizer) > self.spec.vocab_size:
            raise CheckpointError(
                f"{path}: the tokenizer has {len(tokenizer)} tokens, "
                f"the model's vocabulary {self.spec.vocab_size}"
            )

    @classmethod
    def open(
        cls, path: Path | str, template_settings: ChatTemplateSettings | None = None
    ) -> Checkpoint:
        """The checkpoint in ``path``, its chat template probed within ``template_settings``
        (default: the environment's). CheckpointError says what makes it unusable."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} is not a model directory: it has no config.json")
        if not sorted(path.glob("*.safetensors")):
            raise CheckpointError(f"{path} holds no *.safetensors weights")
        try:
            refuse_custom_code(path)
        except CustomCodeRefused as exc:
            raise CheckpointError(str(exc)) from None
        try:
            config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        except (ValueError, KeyError, OSError) as exc:
            raise CheckpointError(f"{path}/config.json: {exc}") from None
        renderer = shared_renderer(template_settings)
        checkpoint = cls(path, config, _load_tokenizer(path), renderer)
        checkpoint._probe_chat_templates()
        return checkpoint

    @classmethod
    def builtin_demo(cls) -> Checkpoint:
        """The demo policy's description without a directory: what a worker started on
        its own (no RTRL_MODEL_DIR) serves. Its weights arrive from weight_sync, as
        always; only ``load_model`` and ``tensors`` need the directory the warm start
        writes (``rtrl up`` names it to every service)."""
        return cls(Path("<built-in demo policy>"), policy.demo_hf_config(), demo_tokenizer())

    @property
    def max_positions(self) -> int:
        """Longest prompt + completion, from the checkpoint's config."""
        return self.spec.max_positions

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Where a completion ends: the config's eos ids and the tokenizer's eos token."""
        ids = list(self.spec.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(int(self.tokenizer.eos_token_id))
        if not ids:
            raise CheckpointError(f"{self.path} names no end-of-sequence token")
        return tuple(ids)

    @cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        """Every stored tensor's shape and dtype, from the safetensors headers."""
        out: dict[str, TensorInfo] = {}
        for file in self._weight_files():
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    out[name] = TensorInfo(tuple(piece.get_shape()), str(piece.get_dtype()))
        return out

    def fingerprint(self, cache_dir: Path | None = None) -> str:
        """Names a lineage: the config, the tokenizer and the stored tensors' bytes.

        Hashing a large model's weights takes seconds, at every start. With ``cache_dir``
        the digest is kept there, keyed by each file's path, size, inode and mtime (what
        make and git trust): a file re-saved in place gets a new mtime, and so a new digest.
        """
        files = [self.path / n for n in ("config.json", "tokenizer.json")]
        files = [f for f in files if f.is_file()] + self._weight_files()
        stamp = xxhash.xxh3_64()
        for file in files:
            st = file.stat()
            stamp.update(
                f"{file.resolve()}\0{st.st_size}\0{st.st_ino}\0{st.st_mtime_ns}\0".encode()
            )
        cached = None if cache_dir is None else cache_dir / f"fingerprint-{stamp.hexdigest()}"
        if cached is not None and cached.is_file():
            return cached.read_text().strip()
        digest = xxhash.xxh3_128()
        for file in files:
            with open(file, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        found = digest.hexdigest()[:16]
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
            partial.write_text(found)
            partial.replace(cached)  # atomic: ranks starting together may race here
        return found

    def lineage_name(self, cache_dir: Path | None = None) -> str:
        """The name a run trained from this checkpoint records as its origin."""
        return f"{self.path.name}-{self.fingerprint(cache_dir)}"

    def load_model(self, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
        """The checkpoint as an AutoModelForCausalLM in eval mode (sdpa attention)."""
        if dtype not in DTYPES:
            raise CheckpointError(f"dtype {dtype!r}: expected one of {sorted(DTYPES)}")
        model = AutoModelForCausalLM.from_pretrained(
            self.path, dtype=DTYPES[dtype], attn_implementation="sdpa", trust_remote_code=False
        )
        model.to(device)  # type: ignore[arg-type]  # transformers types .to as a decorator's
        model.eval()
        return model

    # ---- text and token ids ------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """A plain completion prompt's ids, with the special tokens the tokenizer adds
        (the demo's: BOS first)."""
        encoding = self.tokenizer.backend_tokenizer.encode(text, add_special_tokens=True)
        _check_covered(text, encoding.offsets)
        return [int(i) for i in encoding.ids]

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The ids of ``messages`` rendered by the checkpoint's chat template, ending with
        the assistant's turn opened (add_generation_prompt): what
        ``apply_chat_template(..., tools=tools, tokenize=True)`` gives, rendered within the
        bounds, except that a control token spelled in a non-assistant message is text
        (rtrl/chat_tokens.py). Blocks its thread for up to twice the time bound: call it off
        an event loop."""
        return self.tokenize(self.render(messages, tools))

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> RenderedChat:
        """The chat template's text for ``messages``, with where the text of untrusted
        messages lies in it when it could spell a control token (then the template renders
        twice: rtrl/chat_tokens.py). Raises ChatTemplateError."""
        try:
            chat_tokens.refuse_control_text(self.tokenizer.backend_tokenizer, tools or ())
            text = self.render_text(messages, tools, add_generation_prompt=add_generation_prompt)
            indices = chat_tokens.untrusted_contents(messages)
            contents = (str(messages[i]["content"]) for i in indices)
            if not chat_tokens.may_spell_control(self.tokenizer.backend_tokenizer, contents):
                return RenderedChat(text)
            held, placeholders = chat_tokens.with_placeholders(messages, indices)
            placeheld = self.render_text(held, tools, add_generation_prompt=add_generation_prompt)
            return RenderedChat(text, chat_tokens.untrusted_spans(text, placeheld, placeholders))
        except ControlTextRefused as exc:
            raise ChatTemplateError(str(exc)) from None

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template's text for ``messages``, as transformers renders it.
        Raises ChatTemplateError."""
        if not self.tokenizer.chat_template:
            raise ChatTemplateError(
                f"the model in {self.path} has no chat template: use /v1/completions with a prompt"
            )
        try:
            return self.renderer.render(
                self.tokenizer.get_chat_template(),
                messages,
                add_generation_prompt=add_generation_prompt,
                variables=self.tokenizer.special_tokens_map,
                tools=tools or None,
            )
        except ValueError as exc:  # TemplateFailed; or several templates, none the default
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None

    def tokenize(self, rendered: str | RenderedChat) -> list[int]:
        """Rendered chat text as ids: its special tokens' own ids, nothing added; none
        inside a RenderedChat's untrusted spans. Raises ChatTemplateError."""
        if isinstance(rendered, str):
            rendered = RenderedChat(rendered)
        backend = self.tokenizer.backend_tokenizer
        try:
            return chat_tokens.ids_keeping_text(backend, self._text_tokenizer, rendered)
        except ControlTextRefused as exc:
            raise ChatTemplateError(str(exc)) from None

    @cached_property
    def _text_tokenizer(self) -> Tokenizer:
        """The tokenizer matching no added token: untrusted text's (rtrl/chat_tokens.py)."""
        return chat_tokens.text_tokenizer(self.tokenizer.backend_tokenizer)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def _probe_chat_templates(self) -> None:
        """Render each of the tokenizer's chat templates on representative chats; raise
        CheckpointError, naming the template's file and the bound, if one breaks a bound.
        A template that raises on a probe (its own rules about roles) is left to requests."""
        templates = self.tokenizer.chat_template or {}
        named = templates if isinstance(templates, dict) else {None: templates}
        for name, template in named.items():
            for probe in probes(template):
                try:
                    self.renderer.render(
                        template,
                        probe.messages,
                        add_generation_prompt=True,
                        variables=self.tokenizer.special_tokens_map,
                        tools=probe.tools,
                    )
                except TemplateOverBound as exc:
                    raise CheckpointError(
                        f"{_template_origin(self.path, name)}: on {probe.name}, {exc}: rtrl "
                        "refuses a chat template it cannot render within its bounds"
                    ) from None
                except TemplateFailed:
                    continue

    def _weight_files(self) -> list[Path]:
        return sorted(self.path.glob("*.safetensors"))


def _check_covered(text: str, offsets: Sequence[tuple[int, int]]) -> None:
    """A tokenizer without an unknown token drops what its vocabulary lacks: refuse that
    text instead of serving a prompt the user did not write."""
    covered = bytearray(len(text))
    for start, end in offsets:
        covered[start:end] = b"\x01" * (end - start)
    for index, flag in enumerate(covered):
        if not flag:
            raise ValueError(f"character {text[index]!r} is outside the model's vocabulary")


def _load_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path} has no tokenizer.json (a fast tokenizer is required)")
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, trust_remote_code=False)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: the tokenizer does not load: {exc}") from None
    template = path / "chat_template.jinja"
    if not tokenizer.chat_template and template.is_file():
        tokenizer.chat_template = template.read_text()
    return tokenizer


def _template_origin(path: Path, name: str | None) -> str:
    """Where the chat template called ``name`` (None: the only one) was read from."""
    main = name in (None, "default")
    file = path / ("chat_template.jinja" if main else f"additional_chat_templates/{name}.jinja")
    if file.is_file():
        return str(file)
    return f"{path / 'tokenizer_config.json'} (chat_template{'' if name is None else ' ' + name})"


# ---- the built-in demo policy as a checkpoint directory -------------------------------

DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
)
"""The demo policy knows no roles: a chat is its messages' text, after BOS."""

AGENT_CHAT_TEMPLATE = (
    "{#- rtrl-tool-calls: bang -#}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- message['content'] or '' -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "!{{ call['function']['name'] }}"
    "{%- if call['function']['arguments'] %} {{ call['function']['arguments'] | tojson }}"
    "{%- endif %}{{ '\\n' }}"
    "{%- endfor -%}"
    "{{- eos_token -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "={{ message['content'] }}{{ '\\n' }}"
    "{%- else -%}"
    "{{- message['content'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
"""The demo agent's template (simulator/agent.py): a user's message as its text, an assistant
turn as its text, then a line ``!name`` (with any arguments as JSON) per tool call, then the
end token; a tool's answer as ``=`` and its text on a line. BANG_MARK
(inference/tool_calls.py) tells the serving API to parse calls in that syntax."""


def demo_tokenizer(chat_template: str = DEMO_CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """The demo policy's character vocabulary (rtrl.policy.encode) as a tokenizer: a BPE
    model without merges is one token per character; BOS is added in front."""
    vocab = {"<pad>": policy.PAD, "<s>": policy.BOS, "</s>": policy.EOS}
    vocab.update({ch: policy.encode(ch)[0] for ch in policy.CHARS})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", policy.BOS)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = chat_template
    return fast


def write_demo_checkpoint(
    out_dir: Path,
    weights: Mapping[str, torch.Tensor],
    config: policy.PolicyConfig,
    chat_template: str = DEMO_CHAT_TEMPLATE,
) -> Path:
    """Save the demo policy with ``weights`` as a model directory at ``out_dir``."""
    model = policy.build_model(config)
    policy.load_weights(model, dict(weights))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    demo_tokenizer(chat_template).save_pretrained(out_dir)
    return out_dir
