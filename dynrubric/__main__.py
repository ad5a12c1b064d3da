from dynrubric.app.cli import main

if __name__ == "__main__":  # the ingest writer process (spawn) imports this module as __mp_main__
    main()
