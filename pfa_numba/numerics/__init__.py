"""Numerics every kernel shares: the online-softmax rule and conversions (``core``), the band
(``band``), the kernels' arguments (``kernel_args``), dtypes."""
