"""``python -m rtrl.ingest``: see ingest.server (``--help`` lists every setting)."""

from rtrl.ingest.server import main

if __name__ == "__main__":
    main()
