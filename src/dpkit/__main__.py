"""`python -m dpkit …` is the `dpkit` command."""

from dpkit.cli.main import run_as_program

if __name__ == "__main__":
    run_as_program()
