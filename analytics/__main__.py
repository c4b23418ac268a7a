"""``python -m rtrl.analytics``: see analytics.service (``--help`` lists every setting)."""

from rtrl.analytics.service import main

if __name__ == "__main__":
    main()
