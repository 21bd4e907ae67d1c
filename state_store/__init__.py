"""The Zarr canonical state store (see the state-store issue); not built yet."""
