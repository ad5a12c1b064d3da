from dynrubric.cli import main

main()
