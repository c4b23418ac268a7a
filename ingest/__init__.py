"""The ingest gateway: validates product telemetry, deduplicates it and writes it to Kafka."""
