"""Subcommands of the ``horizon-ray`` console script: one module each, ``add_arguments`` + ``run``."""
