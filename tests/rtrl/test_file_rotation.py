"""L9: the files the embedded stack appends to forever stay under their bound when written
past it: the span and metric files of the OpenTelemetry file exporter
(RTRL_OTEL_FILE_MAX_BYTES) and every process's log (RTRL_LOG_MAX_BYTES, rotated by the
supervisor). On e9251e0 neither was ever rotated: a span per reward, a line per refusal,
until the disk was full."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rtrl import procs
from rtrl.rotation import backup_of, rotate_if_over

BOUND = 64 * 1024

SPANS = textwrap.dedent(
    """
    from opentelemetry import trace
    from rtrl import otel
    from rtrl.config import StackSettings

    otel.configure("probe", StackSettings())
    tracer = trace.get_tracer("probe")
    for n in range(5_000):
        with tracer.start_as_current_span("request", attributes={"pad": "x" * 200, "n": n}):
            pass
    """
)


@pytest.mark.guarantee(7)
def test_l9_span_files_stay_under_their_bound_when_written_past_it(tmp_path):
    """L9: 5,000 spans of ~500 bytes (2.5 MB) through the file exporter with a bound of
    64 KiB: the spans file and its one predecessor each hold at most the bound, and the
    newest spans are in them."""
    env = {
        **os.environ,
        "RTRL_STATE_DIR": str(tmp_path),
        "RTRL_OTEL_EXPORTER": "file",
        "RTRL_OTEL_FILE_MAX_BYTES": str(BOUND),
    }
    subprocess.run([sys.executable, "-c", SPANS], env=env, check=True, timeout=120)
    files = sorted((tmp_path / "otel").iterdir())
    assert {f.name for f in files} >= {"probe-0.spans.jsonl", "probe-0.spans.jsonl.1"}
    sizes = {f.name: f.stat().st_size for f in files}
    assert all(size <= BOUND for size in sizes.values()), sizes
    newest = (tmp_path / "otel" / "probe-0.spans.jsonl").read_text().splitlines()
    assert '"n": 4999' in newest[-1] or '"n":4999' in newest[-1].replace(" ", "")


@pytest.mark.guarantee(7)
def test_l9_a_log_written_past_its_bound_is_rotated_under_its_writer(tmp_path):
    """L9: a process writing its log through the O_APPEND descriptor the supervisor gave it
    (procs.open_log) keeps writing after the supervisor's rotation, and the log and its
    predecessor each stay near the bound (one rotation check's worth of lines over)."""
    path = tmp_path / "service.log"
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys\nfor n in range(20_000): print('x' * 60, n, flush=True)",
        ],
        stdout=procs.open_log(path),
    )
    rotations = 0
    while writer.poll() is None:
        rotations += rotate_if_over(path, BOUND)
    rotations += rotate_if_over(path, BOUND)
    assert writer.returncode == 0 and rotations > 0
    assert path.stat().st_size <= BOUND and backup_of(path).stat().st_size < 20 * BOUND
    last = path.read_text().splitlines() or backup_of(path).read_text().splitlines()
    assert last[-1].endswith(" 19999")
    assert oct(backup_of(path).stat().st_mode & 0o777) == "0o600"
