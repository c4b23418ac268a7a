"""Helpers the tests share across directories: plain functions, classes and case tables,
imported as ``from support.<module> import ...`` (tests/ is on sys.path because
tests/conftest.py lives there). Fixtures live in conftest.py files, never here, and no
test module imports another."""
