"""Models that need their own Python code are refused: rtrl runs no code a model brings.

A Hugging Face directory can ship Python (``configuration_x.py``, ``modeling_x.py``,
``tokenization_x.py``) and name it in ``auto_map``; transformers runs it when asked to
trust it, and at a terminal it asks the operator, one "y" away from running whatever the
directory holds. Every loader here passes ``trust_remote_code=False``, and, before any of
them reads the directory, this check refuses what would need that code, saying so, rather
than letting transformers fail later with advice to trust it.

Allowed, by allow-list: a ``model_type`` transformers itself implements, and no
``auto_map`` in the files a loader reads (config.json, tokenizer_config.json).
"""

from __future__ import annotations

import json
from pathlib import Path

READ_BY_LOADERS = ("config.json", "tokenizer_config.json")
"""The files of a model directory whose ``auto_map`` a transformers loader would follow."""


class CustomCodeRefused(ValueError):
    """The directory's model needs code of its own; the message says where it is named."""


def refuse_custom_code(path: Path | str) -> None:
    """Raise CustomCodeRefused unless transformers' own classes load the model in ``path``.
    A file that does not parse is left to its loader, which refuses it naming the file."""
    path = Path(path)
    for name in READ_BY_LOADERS:
        content = _json_object(path / name)
        if content is not None and "auto_map" in content:
            named = content["auto_map"]
            classes = ", ".join(sorted(named)) if isinstance(named, dict) else "classes"
            raise CustomCodeRefused(
                f"{path / name} names code of its own (auto_map: {classes}): the model needs "
                "custom code, and rtrl does not run a model's own code"
            )
    config = _json_object(path / "config.json")
    if config is None:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        raise CustomCodeRefused(
            f"{path / 'config.json'}: model_type {model_type!r} is not an architecture "
            "transformers implements: the model needs custom code, and rtrl does not run a "
            "model's own code"
        )


def _json_object(file: Path) -> dict | None:
    try:
        content = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None
