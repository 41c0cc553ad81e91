from kvd.cli import main

main()
