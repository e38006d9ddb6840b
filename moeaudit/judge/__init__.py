"""From receipts to a decision, torch-free: the policy, the envelope algebra, margins, gates,
and the one check list (:mod:`moeaudit.judge.decide`) that both ``certify`` and ``gate`` use."""
