from weight_sync.server import main

main()
