"""``python -m moeaudit.schemas``: regenerate the shipped JSON Schemas from the record types."""

from moeaudit.schemas import write

for path in write():
    print(path)
