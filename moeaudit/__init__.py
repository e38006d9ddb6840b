"""moeaudit: training-health audits and signed certificates for Mixture-of-Experts runs."""

__version__ = "0.3.0"
