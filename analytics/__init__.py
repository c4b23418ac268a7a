"""The analytics sink: every topic into ClickHouse, and the A/B report read from it."""
