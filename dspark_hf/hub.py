"""placeholder: being written"""


def add_cli(sub, command):
    """Register this module's `dspark` subcommands (see cli.main)."""
