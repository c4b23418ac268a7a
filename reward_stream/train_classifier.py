"""Train the dissatisfaction head and score it against the rule fallback on the held-out split.

    python -m rtrl.reward_stream.train_classifier

Reads the committed corpus (reward_stream/data/followups.jsonl), embeds every message
once with all-MiniLM-L6-v2, fits the logistic head on the ``train`` templates, and
writes the head and a JSON of its provenance and held-out metrics next to the corpus.
The rules (signals.is_dissatisfied) are scored on the same held-out messages in the
same run, so the two rows of the printed table are directly comparable.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file

from rtrl.reward_stream.classifier import (
    ENCODER_NAME,
    HEAD_META_PATH,
    HEAD_PATH,
    Encoder,
    Head,
    load_encoder,
)
from rtrl.reward_stream.followup_corpus import CORPUS_PATH, FollowUp, corpus_sha256, load
from rtrl.reward_stream.signals import is_dissatisfied


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of the head. Only the training templates choose them."""

    l2_grid: tuple[float, ...] = (1e-5, 1e-4, 1e-3, 1e-2)
    """Candidate weights of the L2 penalty on the head's weights (the bias is not
    penalised); the one with the best template-grouped cross-validated F1 on the train
    split is used."""
    cv_folds: int = 5
    """Folds of that cross-validation; a template's variants always share a fold."""
    max_iter: int = 500
    """L-BFGS iterations; the convex loss converges well before this."""
    threshold: float = 0.5
    """Probability at or above which a follow-up is called dissatisfied."""
    seed: int = 0
    """Seeds torch so the head is bit-for-bit reproducible on one machine."""

    def __post_init__(self) -> None:
        if (
            min(self.l2_grid, default=-1) < 0
            or self.cv_folds < 2
            or self.max_iter < 1
            or not 0 < self.threshold < 1
        ):
            raise ValueError(f"bad TrainConfig: {self}")


@dataclass(frozen=True)
class Metrics:
    accuracy: float
    precision: float
    recall: float
    f1: float
    n: int


def metrics(predicted: list[bool], labels: list[int]) -> Metrics:
    tp = sum(p and y == 1 for p, y in zip(predicted, labels, strict=True))
    fp = sum(p and y == 0 for p, y in zip(predicted, labels, strict=True))
    fn = sum(not p and y == 1 for p, y in zip(predicted, labels, strict=True))
    correct = sum(p == (y == 1) for p, y in zip(predicted, labels, strict=True))
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return Metrics(correct / len(labels), precision, recall, f1, len(labels))


def fit_head(
    embeddings: torch.Tensor, labels: torch.Tensor, l2: float, config: TrainConfig
) -> Head:
    """Logistic regression by full-batch L-BFGS: a few hundred rows, a convex loss."""
    torch.manual_seed(config.seed)
    weight = torch.zeros(embeddings.shape[1], requires_grad=True)
    bias = torch.zeros((), requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [weight, bias], max_iter=config.max_iter, line_search_fn="strong_wolfe"
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        logits = embeddings @ weight + bias
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        loss = loss + l2 * weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return Head(weight.detach().clone(), bias.detach().clone(), config.threshold)


def choose_l2(
    embeddings: torch.Tensor, train: list[FollowUp], config: TrainConfig
) -> dict[float, float]:
    """Cross-validated F1 per candidate L2 weight, folds grouped by template so each
    validation fold, like the held-out split, holds only phrasings its head never saw."""
    fold = torch.tensor(
        [int(hashlib.md5(f.template.encode()).hexdigest(), 16) % config.cv_folds for f in train]
    )
    labels = torch.tensor([float(f.label) for f in train])
    scores = {}
    for l2 in config.l2_grid:
        predicted: list[bool] = []
        truth: list[int] = []
        for k in range(config.cv_folds):
            head = fit_head(embeddings[fold != k], labels[fold != k], l2, config)
            predicted += (head.probability(embeddings[fold == k]) >= head.threshold).tolist()
            truth += [
                f.label for f, in_fold in zip(train, (fold == k).tolist(), strict=True) if in_fold
            ]
        scores[l2] = metrics(predicted, truth).f1
    return scores


def evaluate(head: Head, embeddings: torch.Tensor, heldout: list[FollowUp]) -> dict[str, Metrics]:
    """Held-out metrics of the head and of the rules, on the same messages."""
    labels = [f.label for f in heldout]
    predicted = (head.probability(embeddings) >= head.threshold).tolist()
    return {
        "classifier": metrics(predicted, labels),
        "rules": metrics([is_dissatisfied(f.message) for f in heldout], labels),
    }


def _latency_ms(encoder: Encoder, messages: list[str]) -> tuple[float, float]:
    """Per-message embedding time (ms), one batch vs one call per message."""
    start = time.perf_counter()
    encoder.embed(messages)
    batched = (time.perf_counter() - start) / len(messages)
    start = time.perf_counter()
    for message in messages:
        encoder.embed([message])
    return 1000 * batched, 1000 * (time.perf_counter() - start) / len(messages)


def main(config: TrainConfig = TrainConfig()) -> None:
    torch.set_num_threads(min(torch.get_num_threads(), 2))  # the CI box is shared
    corpus = load()
    encoder = load_encoder()
    embeddings = torch.cat(
        [encoder.embed([f.message for f in corpus[i : i + 64]]) for i in range(0, len(corpus), 64)]
    )
    is_train = torch.tensor([f.split == "train" for f in corpus])
    labels = torch.tensor([float(f.label) for f in corpus])
    heldout = [f for f in corpus if f.split == "heldout"]
    train = [f for f in corpus if f.split == "train"]

    cv_f1 = choose_l2(embeddings[is_train], train, config)
    l2 = max(cv_f1, key=cv_f1.__getitem__)
    head = fit_head(embeddings[is_train], labels[is_train], l2, config)
    results = evaluate(head, embeddings[~is_train], heldout)

    save_file({"weight": head.weight, "bias": head.bias}, HEAD_PATH)
    meta = {
        "embedding_model": ENCODER_NAME,
        "pooling": "mean over attention mask, L2-normalised",
        "corpus": CORPUS_PATH.name,
        "corpus_sha256": corpus_sha256(),
        "n_train": int(is_train.sum()),
        "n_heldout": len(heldout),
        "train_config": asdict(config),
        "l2": l2,
        "cv_f1_by_l2": {str(k): v for k, v in cv_f1.items()},
        "threshold": config.threshold,
        "heldout_metrics": {name: asdict(m) for name, m in results.items()},
    }
    HEAD_META_PATH.write_text(json.dumps(meta, indent=2) + "\n")

    table = Table(
        title=f"dissatisfaction, held-out split ({len(heldout)} messages, templates unseen in training)"
    )
    for column in ("scorer", "accuracy", "precision", "recall", "F1"):
        table.add_column(column, justify="left" if column == "scorer" else "right")
    for name, m in results.items():
        table.add_row(name, *(f"{v:.3f}" for v in (m.accuracy, m.precision, m.recall, m.f1)))
    console = Console()
    console.print(
        f"L2 weight {l2:g} (grouped {config.cv_folds}-fold CV F1 on train: "
        + ", ".join(f"{k:g}: {v:.3f}" for k, v in cv_f1.items())
        + ")"
    )
    console.print(table)
    batched, unbatched = _latency_ms(encoder, [f.message for f in heldout[:64]])
    console.print(
        f"embedding latency per message: {batched:.2f} ms batched (64), {unbatched:.2f} ms one by one"
    )
    console.print(f"wrote {HEAD_PATH} and {HEAD_META_PATH.name}")


if __name__ == "__main__":
    main()
