"""What the HTTP server and batch jobs share, below both: the images API's request body and its errors
(protocol.py), the uploaded images it references (uploads.py), the server's settings (config.py) and the conversion
of a body into a `GenerationRequest` (conversion.py)."""
