"""Tests of the trainer: the objective, the journal, the eval gate, signed rewards, shedding,
FSDP, and the trainer process killed mid-training. Reward records to train on come from
support/trainer.py; the weight_sync server it publishes to is tests/conftest.py's.

No fixture is used by this directory's tests alone: the shared ones are in
tests/conftest.py, and a fixture one module needs stays in that module."""
