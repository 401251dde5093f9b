"""The versioned store of stage outputs, the Prefect cache keyed on it, and the
helpers that publish stage outputs as Prefect UI artifacts."""
