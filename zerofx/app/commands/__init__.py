"""The ``zerofx`` subcommands, one module each: its flags (``add_parser``) and what it runs
(``run``). ``zerofx.app.cli`` builds the top-level parser from them and dispatches."""
