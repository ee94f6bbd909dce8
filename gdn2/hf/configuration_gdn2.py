"""Hugging Face configuration of a gdn2 model: the fields of ``gdn2.config.Config``, standalone.

This file is copied into every exported model folder and imports nothing from gdn2, so that
``AutoConfig.from_pretrained(folder, trust_remote_code=True)`` works where gdn2 is not installed.
"""

from transformers import PretrainedConfig


class GDN2Config(PretrainedConfig):
    """A GPT whose token mixers are Gated DeltaNet-2 layers and (sliding-window) attention layers.

    Layer ``i`` is GDN-2 when ``gdn2_per_layer > 0 and i % gdn2_per_layer == 0``, else attention over
    the last ``sliding_window`` keys (the query included), or full causal when it is None. The GDN-2
    gates vary per channel or per head (``gdn2_decay``, ``gdn2_erase``, ``gdn2_write``: "channel" or
    "head"); ``gdn2_tied_gates``: one gate per value head serves as erase and write gate.
    """

    model_type = "gdn2"
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "num_key_value_heads": "n_query_groups", "max_position_embeddings": "block_size",
                     "rms_norm_eps": "norm_eps"}

    def __init__(self, block_size=4096, vocab_size=32000, n_layer=18, n_embd=2304, n_head=18, n_query_groups=None,
                 head_size=None, sliding_window=2048, rope_base=10000.0, intermediate_size=6784, norm_eps=1e-5,
                 gdn2_per_layer=2, gdn2_num_heads=16, gdn2_head_dim=128, gdn2_num_v_heads=None, gdn2_expand_v=1.0,
                 gdn2_conv_size=4, gdn2_gate_rank=128, allow_neg_eigval=False, gdn2_recurrent_max_len=64,
                 gdn2_decay="channel", gdn2_erase="channel", gdn2_write="channel", gdn2_tied_gates=False,
                 gdn2_name="custom", use_cache=True, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                 **kwargs):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.n_layer = n_layer
        self.n_embd = n_embd
        self.n_head = n_head
        self.n_query_groups = n_query_groups if n_query_groups is not None else n_head
        self.head_size = head_size if head_size is not None else n_embd // n_head
        self.sliding_window = sliding_window
        self.rope_base = rope_base
        self.intermediate_size = intermediate_size
        self.norm_eps = norm_eps
        self.gdn2_per_layer = gdn2_per_layer
        self.gdn2_num_heads = gdn2_num_heads
        self.gdn2_head_dim = gdn2_head_dim
        self.gdn2_num_v_heads = gdn2_num_v_heads if gdn2_num_v_heads is not None else gdn2_num_heads
        self.gdn2_expand_v = gdn2_expand_v
        self.gdn2_conv_size = gdn2_conv_size
        self.gdn2_gate_rank = gdn2_gate_rank
        self.allow_neg_eigval = allow_neg_eigval
        self.gdn2_recurrent_max_len = gdn2_recurrent_max_len
        self.gdn2_decay = gdn2_decay
        self.gdn2_erase = gdn2_erase
        self.gdn2_write = gdn2_write
        self.gdn2_tied_gates = gdn2_tied_gates
        self.gdn2_name = gdn2_name
        self.use_cache = use_cache
        super().__init__(bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    def is_gdn2_layer(self, i):
        return self.gdn2_per_layer > 0 and i % self.gdn2_per_layer == 0

    @property
    def gdn2_head_v_dim(self):
        return int(self.gdn2_head_dim * self.gdn2_expand_v)
