"""The use cases behind the command line, one module per command (docs/architecture.md).

Each module's functions take typed arguments and return typed results; they parse no arguments
and print nothing: notes, warnings, progress and the passphrase prompt reach the user through
:class:`moeaudit.commands.common.Hooks`, which ``moeaudit.cli`` fills with its consoles.
A command is usable from Python exactly as the CLI runs it."""
