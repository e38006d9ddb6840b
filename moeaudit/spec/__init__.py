"""The model description, torch-free and below every package that reads or replays a model:
``ModelSpec`` and its records with the generic config readers (:mod:`.config`), the key-name
layouts (:mod:`.layouts`) and torchtitan's name rules (:mod:`.torchtitan`). The families
(:mod:`moeaudit.families`) build a ``ModelSpec`` from a config; the checkpoint reader
(:mod:`moeaudit.checkpoint`) and the replay use it."""
