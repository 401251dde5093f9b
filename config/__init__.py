"""Configuration: the typed settings of a run (``settings.py``), the presets as files users
copy (``presets/NAME.yaml``) and config files as ``--config`` reads them (``config_file.py``).
The bottom of the house: it imports nothing of bardflow but the error family."""
