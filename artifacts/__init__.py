"""The versioned store of stage outputs, and the helpers that publish stage outputs as
Prefect UI artifacts."""
