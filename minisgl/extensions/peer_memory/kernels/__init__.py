"""The peer-memory Triton kernels (imported on CUDA only, by the reducer)."""
