"""One way to name a policy (rtrl/checkpoint.py): a Hugging Face model directory, opened
with clear errors for what is missing; the demo policy written as one encodes as the
built-in character vocabulary does."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from rtrl import policy
from rtrl.checkpoint import (
    ChatTemplateError,
    Checkpoint,
    CheckpointError,
    demo_tokenizer,
    write_demo_checkpoint,
)
from rtrl.ops.tiny_model import write_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3", "qwen3")


def test_a_checkpoint_describes_its_model_tokens_and_tensors(qwen3):
    ckpt = Checkpoint.open(qwen3)
    assert ckpt.spec.model_type == "qwen3" and ckpt.spec.qk_norm and ckpt.spec.fast_path
    assert ckpt.max_positions == 256
    assert ckpt.eos_token_ids == (2,)
    text = "héllo 你好\t🙂"
    assert ckpt.decode(ckpt.encode(text)) == text
    model = ckpt.load_model()
    stored = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert {name: info.shape for name, info in ckpt.tensors.items()} == stored
    assert {info.dtype for info in ckpt.tensors.values()} == {"F32"}
    assert ckpt.lineage_name().startswith("qwen3-")


def test_the_fingerprint_is_kept_while_no_file_changes_and_redone_when_one_does(tmp_path):
    """A large model's weights are hashed once, not at every trainer start: the digest is
    kept by each file's size, inode and mtime, and a file re-saved in place (new mtime)
    is hashed again."""
    directory = write_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    cache = tmp_path / "cache"
    ckpt = Checkpoint.open(directory)
    first = ckpt.fingerprint(cache)
    assert first == ckpt.fingerprint() and len(list(cache.iterdir())) == 1
    weights = directory / "model.safetensors"
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the last tensor
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    # Same path, size, inode and mtime: the kept digest is trusted without reading a byte...
    assert Checkpoint.open(directory).fingerprint(cache) == first
    # ...but not by a reader without the cache, nor once the mtime moves.
    changed = Checkpoint.open(directory).fingerprint()
    assert changed != first
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns + 1))
    assert Checkpoint.open(directory).fingerprint(cache) == changed


def test_the_chat_template_renders_ids_and_refuses_clearly(qwen3, tmp_path):
    ckpt = Checkpoint.open(qwen3)
    ids = ckpt.render_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ckpt.decode(ids).endswith("assistant\n")
    broken = shutil.copytree(qwen3, tmp_path / "broken")
    (broken / "chat_template.jinja").write_text("{{ raise_exception('no system turns') }}")
    with pytest.raises(ChatTemplateError, match="no system turns"):
        Checkpoint.open(broken).render_chat([{"role": "user", "content": "hi"}])
    none = shutil.copytree(qwen3, tmp_path / "none")
    (none / "chat_template.jinja").unlink()
    config = json.loads((none / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (none / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Checkpoint.open(none).render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("remove", "message"),
    [
        ("config.json", "no config.json"),
        ("model.safetensors", "no \\*.safetensors"),
        ("tokenizer.json", "no tokenizer.json"),
    ],
)
def test_an_incomplete_directory_is_refused_naming_what_is_missing(
    qwen3, tmp_path, remove, message
):
    copy = shutil.copytree(qwen3, tmp_path / "copy")
    (copy / remove).unlink()
    with pytest.raises(CheckpointError, match=message):
        Checkpoint.open(copy)


def test_the_demo_policy_as_a_directory_tokenizes_like_the_builtin_vocabulary(tmp_path):
    path = write_demo_checkpoint(
        tmp_path / "demo", policy.state_dict_fp32(policy.build_model()), policy.PolicyConfig()
    )
    ckpt = Checkpoint.open(path)
    assert ckpt.spec == policy.DEMO_SPEC
    text = "def add(a, b):\n  return 'a' + b\n"
    assert ckpt.encode(text) == [policy.BOS, *policy.encode(text)]
    assert ckpt.decode(ckpt.encode(text)) == text
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        ckpt.encode("café")
    assert len(demo_tokenizer()) == policy.VOCAB_SIZE
    assert Checkpoint.builtin_demo().encode(text) == ckpt.encode(text)
