"""The engine: core (the loop), scheduler (CPU), model runner (the device), client protocol, facades."""
