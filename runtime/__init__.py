"""The runtime of a training run: its processes (launch, supervision, the multi-host group),
stop signals, the CPU step tuner, and one training run from a request to its files. It drives
``bardflow.model``; neither Prefect nor the store is known here."""
