from rtrl.docgen import main

if __name__ == "__main__":
    main()
