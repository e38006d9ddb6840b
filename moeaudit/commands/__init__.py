"""The CLI's commands, one module each; :mod:`moeaudit.cli` registers them."""
