"""Operating a Prefect server for bardflow: starting it (in the background or for one run),
this host's training slot, and the notifications it sends.
"""
