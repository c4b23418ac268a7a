"""``python -m ingest``: see ingest.server (``--help`` lists every setting)."""

from ingest.server import main

if __name__ == "__main__":
    main()
