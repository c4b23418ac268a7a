from analytics.service import main

main()
