"""Hugging Face interoperability: ``python -m gdn2 hf export|import`` (see :mod:`gdn2.hf.convert`).

``configuration_gdn2.py``, ``modeling_gdn2.py`` and ``tokenization_gdn2.py`` are standalone: an
export copies them into the model folder, where ``trust_remote_code=True`` loads them without gdn2.
"""
