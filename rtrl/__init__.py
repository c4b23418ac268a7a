"""rtrl: real-time reinforcement learning from product telemetry.

Imports nothing: every service, the CLI and the build (``[tool.setuptools.dynamic]`` in
pyproject.toml) read the version from here without paying for torch.
"""

__version__ = "0.2.0"
