"""A pytest plugin that runs transformers' own model tests on pfa_numba: it registers
pfa_numba's attention function under transformers' name "sdpa" (the mask function stays
transformers' own ``sdpa_mask``), so every test that runs a model with
``attn_implementation="sdpa"`` runs it on pfa_numba. From a transformers source checkout::

    PYTHONPATH=/path/to/pfa_numba/scripts HF_HUB_OFFLINE=1 python -m pytest \\
        -p transformers_as_sdpa tests/models/llama/test_modeling_llama.py

and the same command without ``-p transformers_as_sdpa`` for torch's SDPA; docs/guide.md
gives both runs' counts.
"""
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import pfa_numba.integrations.transformers as pfa_hf

AttentionInterface.register("sdpa", pfa_hf.attention_forward)   # the global mapping
if ALL_ATTENTION_FUNCTIONS["sdpa"] is not pfa_hf.attention_forward:
    raise RuntimeError("transformers' 'sdpa' attention was not replaced by pfa_numba's")
