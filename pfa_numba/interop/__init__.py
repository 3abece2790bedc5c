"""Arrays of other libraries: torch tensors (``torch_tensors``) and CUDA arrays of any library
(``cuda_arrays``), without importing them up front."""
