from rtrl.ops.cli import main

main()
