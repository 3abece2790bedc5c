"""The call: its arguments checked (``checks``, ``pfa``, ``fia``, ``masks``, ``quant``,
``antiquant``) and planned into the problem the kernels compute (``problem``)."""
