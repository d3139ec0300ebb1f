"""Model loading (local diffusers folders, presets) and prompt conditioning."""
