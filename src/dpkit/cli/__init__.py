"""The `dpkit` command. Each subcommand lives in its own module with add_parser() and run()."""
