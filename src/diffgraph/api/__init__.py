"""What the HTTP server and batch jobs share, below both: the images API's request body, its errors, the images that
come with it and its conversion into a `GenerationRequest` (protocol.py), and the server's settings (config.py)."""
