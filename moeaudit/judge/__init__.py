"""From receipts to a decision, torch-free: the envelope algebra, the gates, the promotion rules
and the one check list (:mod:`moeaudit.judge.decide`) that both ``certify`` and ``gate`` use.
What they read sits below every package that computes receipts: the policy
(:mod:`moeaudit.policy`) and the lifecycle margins (:mod:`moeaudit.margins`)."""
