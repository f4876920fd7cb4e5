"""The int4 Triton kernels (imported on CUDA only, by the method's forward)."""
