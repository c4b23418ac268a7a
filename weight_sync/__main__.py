"""``python -m rtrl.weight_sync``: see weight_sync.server (``--help`` lists every setting)."""

from rtrl.weight_sync.server import main

if __name__ == "__main__":
    main()
