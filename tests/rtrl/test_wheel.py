"""What is installed is one package, ``rtrl``: the wheel puts nothing else at the top of
site-packages, so it lives beside the PyPI projects that own the generic names
(Hugging Face's ``kernels``, which transformers probes for; coqui's ``trainer``...).

The wheel is the one users get (support.dists: ``python -m build`` from a copy of the
checkout's files, built once per session and shared with tests/rtrl/test_install.py). Here
it is installed without its dependencies into a fresh virtualenv that borrows the project's
own (torch, transformers) through a path entry placed after its own site-packages: what is
proved is where the files land, not the dependencies (test_install.py proves those).
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from support import dists

HF_KERNELS = "kernels==0.16.2"
"""The newest release transformers (5.17) accepts: is_kernels_available() wants >=0.16, <0.17."""


def _run(python: Path, code: str, cwd: Path) -> str:
    done = subprocess.run(
        [str(python), "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_the_wheel_installs_rtrl_alone_beside_hugging_faces_kernels(tmp_path, tmp_path_factory):
    wheel = dists.built("rtrl", tmp_path_factory).wheel
    with zipfile.ZipFile(wheel) as archive:
        record = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        installed = [line.split(",")[0] for line in archive.read(record).decode().splitlines()]
    tops = {path.split("/")[0] for path in installed if ".dist-info/" not in path}
    assert tops == {"rtrl"}
    for module in ("trainer/loop.py", "ops/cli.py", "kernels/delta.py", "simulator/tasks.py"):
        assert f"rtrl/{module}" in installed, module
    assert any(p.startswith("rtrl/reward_stream/data/") for p in installed)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        _run(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])", tmp_path).strip()
    )
    # After the venv's own site-packages: torch, transformers and the rest, not the
    # checkout's editable rtrl (a plain path entry runs none of that directory's .pth files).
    (site / "zz_project_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [str(python), "-m", "pip", "install", "-q", "--no-deps"]
    subprocess.run([*pip, str(wheel)], check=True, capture_output=True)

    # rtrl alone: nothing answers to "kernels", and transformers does not think it has them.
    shown = _run(
        python,
        """
        import importlib.util
        import rtrl.kernels, rtrl.ops.cli, rtrl.trainer.loop
        from transformers.utils import is_kernels_available
        print(rtrl.kernels.__file__)
        print(importlib.util.find_spec("kernels"), importlib.util.find_spec("trainer"))
        print(is_kernels_available())
        """,
        tmp_path,
    ).split()
    assert shown[0].startswith(str(site / "rtrl" / "kernels")), shown
    assert shown[1:] == ["None", "None", "False"], shown

    # Hugging Face's kernels beside it: both import, each its own.
    # With what it needs that the project does not have (pip sees the borrowed packages).
    subprocess.run([*pip[:-1], HF_KERNELS], check=True, capture_output=True)
    shown = _run(
        python,
        """
        import importlib.metadata
        import kernels, rtrl.kernels
        from transformers.utils import is_kernels_available
        print(kernels.__file__, rtrl.kernels.__file__)
        print(importlib.metadata.version("kernels"), callable(kernels.get_kernel))
        print(is_kernels_available(), hasattr(rtrl.kernels, "get_kernel"))
        """,
        tmp_path,
    ).split()
    assert shown[0].startswith(str(site / "kernels")), shown
    assert shown[1].startswith(str(site / "rtrl" / "kernels")), shown
    assert shown[2:] == ["0.16.2", "True", "True", "False"], shown
