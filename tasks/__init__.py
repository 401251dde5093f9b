"""One module per pipeline stage; each stage is a cached Prefect task over the store."""
