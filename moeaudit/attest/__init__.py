"""Attestation, torch-free: the in-toto statement, its DSSE signature and verification, and the
claims table each receipt licenses (`003` Table 4)."""
