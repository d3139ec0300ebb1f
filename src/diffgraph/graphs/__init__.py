"""The captured denoising step and CUDA-graph machinery."""
