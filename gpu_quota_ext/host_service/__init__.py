"""The host quota service: one ledger for every user of a JupyterHub host (see contract.py)."""
