from rtrl.ops.docgen import main

if __name__ == "__main__":
    main()
