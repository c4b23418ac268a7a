"""`rtrl report`'s HTML renders: every plot loads in headless Chromium, and the page
rendered to PNG shows them (the plots' colours are on screen, not broken-image icons).

Chromium comes from the system (scripts/bootstrap.sh installs it with apt-get)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from matplotlib.image import imread

from rtrl import topics
from rtrl.analytics import report, schema
from rtrl.analytics.query import client_query_fn, connect
from rtrl.config import StackSettings
from rtrl.v1 import trainer_pb2
from support import signed
from support.analytics import hand_made_records

TAB_ORANGE = np.array([1.0, 127 / 255, 14 / 255])


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.fail(
        "headless Chromium is needed to render the report: apt-get install chromium (scripts/bootstrap.sh does)"
    )


def trainer_step(step: int, published: bool, well_formed: float) -> trainer_pb2.TrainerStep:
    return trainer_pb2.TrainerStep(
        step_id=f"warm:{step}",
        lineage="warm",
        step=step,
        base_version=step - 1,
        version=step if published else -1,
        published=published,
        ts_ms=1_700_000_000_000 + step * 1000,
        rollouts=32,
        tokens=900,
        reward_mean=0.4 + 0.02 * step,
        kl=0.001 * step,
        entropy=0.5,
        grad_norm=0.3,
        staleness=[trainer_pb2.StalenessBucket(staleness=s, rollouts=10 + s) for s in range(3)],
        eval_candidate={"well_formed": well_formed, "house_style": 0.3 + 0.05 * step},
        batch_wait_s=0.2,
        step_s=0.25,
        eval_s=0.3,
        publish_s=0.05,
    )


def test_the_report_renders_every_plot_in_headless_chromium(tmp_path):
    client = connect(StackSettings(state_dir=tmp_path))
    schema.create_tables(client)
    # The recording double stands in for the sink's confluent_kafka Consumer.
    sink = signed.checking_sink(client)
    rollouts, rewards = hand_made_records()
    records = [(topics.ROLLOUT, r) for r in rollouts] + [(topics.REWARD, r) for r in rewards]
    records += [
        (topics.TRAINER_STEPS, trainer_step(step, step != 3, 0.95 if step != 3 else 0.4))
        for step in range(1, 7)
    ]
    for offset, (topic, message) in enumerate(records):
        sink.add(signed.record(topic, 0, offset, b"k", message.SerializeToString()))
    sink.flush()
    page = report.render(client_query_fn(client), tmp_path / "report.html")
    text = page.read_text()
    assert text.count("<img ") == 4, (
        "A/B by version, reward components, training steps, staleness and latency"
    )

    # Each image decoded: its natural size, read by the page itself once loaded.
    probe = tmp_path / "probe.html"
    probe.write_text(
        text.replace(
            "</body>",
            "<script>window.addEventListener('load', () => { document.title = JSON.stringify("
            "[...document.images].map(i => [i.complete, i.naturalWidth, i.naturalHeight])); });</script></body>",
        )
    )
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--virtual-time-budget=10000",
    ]
    dom = subprocess.run(
        [chromium(), *flags, "--dump-dom", probe.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    title = re.search(r"<title>(.*?)</title>", dom)
    assert title is not None, dom
    images = json.loads(title.group(1).replace("&quot;", '"'))
    assert len(images) == 4 and all(
        complete and width > 400 and height > 200 for complete, width, height in images
    ), images

    # The page as a person sees it: the plots' lines are on screen.
    shot = tmp_path / "report.png"
    subprocess.run(
        [chromium(), *flags, f"--screenshot={shot}", "--window-size=1400,3000", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    pixels = imread(shot)[..., :3]
    assert pixels.shape[:2] == (3000, 1400)
    ink = (pixels < 0.9).any(axis=-1).mean()
    orange = (np.abs(pixels - TAB_ORANGE) < 0.08).all(axis=-1).sum()
    assert ink > 0.03, f"the page is nearly blank ({ink:.1%} of pixels are not white)"
    assert orange > 500, f"the treatment curves are not on screen ({orange} orange pixels)"
