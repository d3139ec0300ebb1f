"""The engine: worker (device), engine facade."""
