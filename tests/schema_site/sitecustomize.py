"""Loaded by every Python process the test suite starts (``tests/conftest.py`` puts this folder
on ``PYTHONPATH`` and sets ``MOEAUDIT_SCHEMA_CHECK``): ``python -m moeaudit …`` run as a
subprocess validates what it writes against the published JSON Schemas, as the suite's own
process does (``tests/schema_check.py``). A document that does not match makes the command
fail, and with it the test that ran it. Nothing is imported until the first write."""

import os
import sys

if os.environ.get("MOEAUDIT_SCHEMA_CHECK") == "1":
    try:
        import moeaudit.jsonio as _jsonio
    except ImportError:  # a process that never imports moeaudit, or before it is installed
        _jsonio = None
    if _jsonio is not None:
        _real = _jsonio.atomic_write

        def _checked(path, data, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("moeaudit"):
                tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
                if tests not in sys.path:
                    sys.path.append(tests)
                import schema_check

                schema_check.check_document(path, data)
                schema_check.note_subprocess(path)
            return _real(path, data, *args, **kwargs)

        _jsonio.atomic_write = _checked
