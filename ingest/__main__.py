from ingest.server import main

main()
