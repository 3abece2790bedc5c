"""pfa_numba inside other libraries' models: :mod:`pfa_numba.integrations.transformers`."""
