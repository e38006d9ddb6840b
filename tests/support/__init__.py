"""Helpers shared by several test modules: code that is not a test, imported by the tests
(test modules import nothing from one another)."""
