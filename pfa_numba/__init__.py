"""pfa_numba: Ascend's prompt_flash_attention on every machine, as Numba kernels.

``prompt_flash_attention`` follows ``mindspore.ops.prompt_flash_attention`` argument for
argument; ``pfa_numba.reference`` is the float64 NumPy meaning the kernels are tested against.
"""
from .api import PfaPlan, explain, prompt_flash_attention, trans_quant_param
from .fia import FiaPlan, explain_fia, fused_infer_attention_score
from .merge import merge_attention
from .sdpa import scaled_dot_product_attention

__version__ = "0.1.0"
__all__ = ["prompt_flash_attention", "fused_infer_attention_score", "PfaPlan", "FiaPlan",
           "merge_attention", "scaled_dot_product_attention", "trans_quant_param", "explain",
           "explain_fia", "__version__"]
