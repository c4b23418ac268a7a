"""``python -m analytics``: see analytics.service (``--help`` lists every setting)."""

from analytics.service import main

if __name__ == "__main__":
    main()
